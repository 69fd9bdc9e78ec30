"""`specsplit-cloud`: the verifier process. Every setting is a flag (overrides SPECSPLIT_CLOUD_*).

Launched by `torchrun --nproc-per-node N --no-python specsplit-cloud ...` it is one verifier whose
target is split over N ranks (cloud/runners/tensor_parallel.py): rank 0 serves, the others run its forwards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import get_args

from pydantic import ValidationError

from cloud.settings import CloudSettings

# seconds a tensor-parallel worker that cannot start waits before it exits, so rank 0's one line is printed
REFUSAL_WAIT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    """One flag per CloudSettings field; its help is the field's description, default and variable."""
    p = argparse.ArgumentParser(prog="specsplit-cloud", description=(
        "Cloud verifier of edge-cloud speculative decoding: REST and gRPC from one process."))
    for name, field in CloudSettings.model_fields.items():
        env = f"SPECSPLIT_CLOUD_{name.upper()}"
        flag = "--" + name.replace("_", "-")
        if name == "api_keys":
            p.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                           help=f"{field.description}; repeatable, a key turns auth on (env {env}, a JSON list)")
            continue
        default = "required" if field.is_required() else f"default {field.default}"
        text = (field.description or "").replace("%", "%%")  # argparse formats help with %
        if bool in (field.annotation, *get_args(field.annotation)):  # --flag, --flag true|false, --no-flag
            literals = [v for arg in get_args(field.annotation) if arg is not bool for v in get_args(arg)]
            choices = "|".join(["true", "false", *literals])  # kv_preallocate also takes "auto"
            p.add_argument(flag, dest=name, nargs="?", const="true", metavar=choices,
                           help=f"{text} ({default}; env {env}; --no-{flag[2:]} for false)")
            p.add_argument(f"--no-{flag[2:]}", dest=name, action="store_const", const="false",
                           help=argparse.SUPPRESS)
            continue
        p.add_argument(flag, dest=name, metavar=name.upper(), help=f"{text} ({default}; env {env})")
    return p


def settings_from_args(argv: list[str] | None = None) -> CloudSettings:
    """Flags given on the command line override SPECSPLIT_CLOUD_* variables; ValidationError if bad."""
    args = build_parser().parse_args(argv)
    return CloudSettings(**{k: v for k, v in vars(args).items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
    except ValidationError as e:
        if any(err["type"] == "missing" and tuple(err["loc"]) == ("model",) for err in e.errors()):
            print("specsplit-cloud: no target model: pass --model DIR (a Hugging Face model directory) or FILE.gguf, or set "
                  "SPECSPLIT_CLOUD_MODEL", file=sys.stderr)
            return 2
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'settings'}: {err['msg']}"
                             for err in e.errors())
        print(f"specsplit-cloud: bad settings: {problems}", file=sys.stderr)
        return 2

    if not _bind_allowed(settings):
        return 2
    from cloud.app import serve
    from cloud.logs import setup_logging
    from cloud.ports import PortInUse
    from cloud.runners.tensor_parallel import world_size
    from cloud.service import VerifierService

    if world_size() > 1:
        return _main_tensor_parallel(settings)
    if not _ports_free(settings):
        return 2
    setup_logging(settings.log_level)
    try:
        service = VerifierService.load(settings)
    except (OSError, ValueError) as e:
        print(f"specsplit-cloud: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(service))
    except OSError as e:
        print(f"specsplit-cloud: cannot serve: {e}", file=sys.stderr)
        return 2 if isinstance(e, PortInUse) else 1
    return 0


def _bind_allowed(settings: CloudSettings) -> bool:
    """Keys, a loopback host, or --allow-open-bind; else one line on stderr (before the model load)."""
    from shared.hosts import is_loopback

    if settings.api_keys or is_loopback(settings.host) or settings.allow_open_bind:
        return True
    print(f"specsplit-cloud: refusing to serve on {settings.host} without keys: anyone who reaches ports "
          f"{settings.http_port} and {settings.grpc_port} would be served; pass --api-key KEY (or "
          "SPECSPLIT_CLOUD_API_KEYS), or --allow-open-bind to serve without keys", file=sys.stderr)
    return False


def _ports_free(settings: CloudSettings) -> bool:
    """Both ports free, checked before the model load; else one line on stderr."""
    from cloud.ports import check_ports_free

    try:
        check_ports_free(settings.host, settings.http_port, settings.grpc_port)
    except OSError as e:
        print(f"specsplit-cloud: cannot start: {e}", file=sys.stderr)
        return False
    return True


def _main_tensor_parallel(settings: CloudSettings) -> int:
    """One rank of a torchrun group: rank 0 serves, the others mirror its forwards."""
    import os

    import torch

    from cloud.app import serve
    from cloud.logs import setup_logging
    from cloud.ports import PortInUse
    from cloud.runners.tensor_parallel import TensorGroup, serve_worker
    from cloud.runners.torch_runner import TargetModel
    from cloud.service import VerifierService

    first = int(os.environ.get("RANK", "0")) == 0
    if settings.runner == "llamacpp":
        if first:
            print("specsplit-cloud: cannot start: --runner llamacpp runs one process; tensor parallelism (torchrun) "
                  "is the PyTorch runner's (--runner torch)", file=sys.stderr)
        return 2
    if first and not _ports_free(settings):
        return 2
    setup_logging(settings.log_level)
    group = TensorGroup(settings.device, op_stale_s=settings.tp_op_timeout_s)
    try:
        model = TargetModel(settings.model, settings.device, settings.dtype, group=group,
                            invariant=settings.batch_invariant)
    except (OSError, ValueError) as e:
        if first:  # every rank refuses alike; one line says why
            print(f"specsplit-cloud: cannot start: {e}", file=sys.stderr)
        else:  # torchrun stops the group when the first rank exits: rank 0 says it first
            time.sleep(REFUSAL_WAIT_S)
        return 2
    if not first:
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        code = serve_worker(model, group)
        group.close()
        return code
    try:
        service = VerifierService(settings, model)
        asyncio.run(serve(service))
    except (OSError, ValueError) as e:
        print(f"specsplit-cloud: cannot serve: {e}", file=sys.stderr)
        return 2 if isinstance(e, PortInUse) else 1
    finally:
        group.stop()
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
