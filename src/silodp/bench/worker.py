"""Fresh-process worker for peak-RSS measurements: ``python -m silodp.bench.worker ...``.

Prints one JSON line with ``peak_rss_mb`` (``resource.getrusage(...).ru_maxrss``). Method
``none`` only builds the model and the data: the baseline subtracted by the benchmarks.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import warnings
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silodp.bench.worker")
    sub = parser.add_subparsers(dest="kind", required=True)
    step = sub.add_parser("step", help="a few training steps of one method")
    step.add_argument("--model", required=True)
    step.add_argument("--batch", type=int, required=True)
    step.add_argument("--method", required=True)
    step.add_argument("--steps", type=int, default=2)
    step.add_argument("--threads", type=int, default=1)
    step.add_argument("--max-extra-bytes", type=float, default=math.inf)
    step.add_argument(
        "--with-opacus", action="store_true", help="import opacus (baseline of Opacus rows)"
    )
    uldp = sub.add_parser("uldp", help="one round of per-subject deltas in every silo")
    uldp.add_argument("--source", required=True)
    uldp.add_argument("--subjects", type=int, required=True)
    uldp.add_argument("--algorithm", default="uldp_avg")
    uldp.add_argument("--path", default="vectorised", choices=("vectorised", "loop", "none"))
    uldp.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR)
    from silodp.bench.common import set_threads

    set_threads(args.threads)
    # Every worker, baselines included, imports what the measured paths import, so the
    # difference to the baseline is memory the computation used, not library code.
    import torch.func  # noqa: F401

    import silodp.algorithms  # noqa: F401
    import silodp.data.build  # noqa: F401
    import silodp.federated.simulator  # noqa: F401

    # The first torch.func transform imports ~800 modules (~75 MB): a one-off library cost
    torch.func.vmap(torch.func.grad(lambda t: t.sum()))(torch.ones(2, 3))
    if args.kind == "step" and (args.with_opacus or args.method.startswith("opacus")):
        try:  # Opacus rows are measured against a baseline that imports it too
            import opacus  # noqa: F401
        except ImportError:
            pass
    if args.kind == "step":
        from silodp.bench.step import worker_step

        out = worker_step(
            args.model,
            args.batch,
            args.method,
            steps=args.steps,
            max_extra_bytes=args.max_extra_bytes,
        )
    else:
        from silodp.bench.uldp import worker_uldp

        out = worker_uldp(args.source, args.subjects, args.algorithm, args.path)
    out["threads"] = torch.get_num_threads()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
