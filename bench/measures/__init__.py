"""One-off measurements, each a subcommand of `specsplit-bench` (bench/run.py MEASURES) with a
`main(argv) -> int` of its own: `acceptance` (acceptance and speed of the edge's drafters against a
cloud on loopback, vs the cloud_only baseline), `block-size` (forward cost and unused KV positions of
the paged pool for several block sizes), `cloud-down` (how long each of N concurrent requests to the
OpenAI server takes to fail with its cloud down), `failover` (failover and scale-out of verifier replicas
behind nginx), `overhead` (the verifier's own overhead per round, over REST and over gRPC, on loopback),
`slow-link` (exactness over a slow link: the edge's default against a fixed deadline with the lossy
fallback), `stream-switch` (the coder pair at one session: cloud_only against the edge's defaults with
and without speculate-or-stream) `profile-rounds` (where a verify round's time goes inside the
cloud, by py-spy samples) and `peer-loop` (cloud_only's stream against llama.cpp's own decode loop
of the coder target). Each loads torch and the models only once its arguments are parsed, so
`specsplit-bench NAME --help` answers without starting a server.
"""
