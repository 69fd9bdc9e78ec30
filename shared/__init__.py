"""The math both sides share: sampling processing, the verify rule, the context hash, wire types.

Pure functions of tensors and seeded generators: no HTTP, gRPC, sessions or clocks here.
"""
