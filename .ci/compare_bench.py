"""This tree's ``sqla-jobs bench`` against another commit's, interleaved in one run.

    python .ci/compare_bench.py REF [--only ceiling,drain,keys] [--rounds 3]
        [--database-url URL] [--json OUT] [--threshold 0.03] [BENCH OPTIONS]

Other options go to both benches as they are (``--jobs 5000``, say). ``REF`` is exported
with ``git archive`` into a scratch directory. Each round runs both versions' own bench
(``--repeat 1``) one after the other, on ``--database-url`` or each on its own embedded
server, the order alternating from round to round, so that the load of a shared machine
falls on both alike.
Every figure both report is compared by its median over the rounds, as this version's over
the other's (for a time, the other's over this one's: above 1 is better either way); and,
for a figure measured against a ceiling, by its ratio to the ceiling of its own run, which
cancels what the machine did to the whole run. Exits 1 when a figure is worse than
``--threshold`` by both measures, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def _export(ref: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(HERE), "archive", ref], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _bench(root: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "sqla_jobs", "bench", "--only", args.only, "--repeat", "1"]
    argv += ["--json", str(out), *args.passed]
    if args.database_url:
        argv += ["--database-url", args.database_url]
    env = os.environ | {"PYTHONPATH": str(root)}
    print(f"-- {root}: {' '.join(argv[1:])}", flush=True)
    subprocess.run(argv, env=env, cwd=root, check=True, stdout=subprocess.DEVNULL)
    metrics: dict[str, Any] = json.loads(out.read_text())["metrics"]
    return metrics


def _gain(name: str, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float | None:
    old = [run[name]["median"] for run in before if run.get(name, {}).get("median")]
    new = [run[name]["median"] for run in after if run.get(name, {}).get("median")]
    if not old or not new:
        return None
    gain = statistics.median(new) / statistics.median(old)
    return gain if before[0][name]["higher_is_better"] else 1 / gain


Runs = list[dict[str, Any]]


def _ratio_gain(name: str, before: Runs, after: Runs) -> float | None:
    old = [run[name]["ratio"] for run in before if run.get(name, {}).get("ratio")]
    new = [run[name]["ratio"] for run in after if run.get(name, {}).get("ratio")]
    if not old or not new:
        return None
    return statistics.median(new) / statistics.median(old)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the commit to compare with")
    parser.add_argument("--only", default="ceiling,drain,keys")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--database-url")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--threshold", type=float, default=0.03)
    args, args.passed = parser.parse_known_args()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "current": []}
    with tempfile.TemporaryDirectory(prefix="compare-bench-") as scratch:
        base = Path(scratch)
        (base / "before").mkdir()
        sides = {"before": _export(args.ref, base / "before"), "current": HERE}
        for round_ in range(args.rounds):
            order = ["before", "current"] if round_ % 2 == 0 else ["current", "before"]
            for side in order:
                out = base / f"{side}-{round_}.json"
                runs[side].append(_bench(sides[side], args, out))
    names = sorted(set(runs["before"][0]) & set(runs["current"][0]))
    worse = []
    report = {}
    print(f"\n{'figure':58} {'current/before':>14} {'of ceiling':>11}")
    for name in names:
        gain = _gain(name, runs["before"], runs["current"])
        ratio = _ratio_gain(name, runs["before"], runs["current"])
        report[name] = {"gain": gain, "ratio_gain": ratio}
        shown = [f"{v:.3f}" if v is not None else "-" for v in (gain, ratio)]
        print(f"{name:58} {shown[0]:>14} {shown[1]:>11}")
        measures = [v for v in (gain, ratio) if v is not None]
        if measures and all(v < 1 - args.threshold for v in measures):
            worse.append(name)
    if args.json:
        Path(args.json).write_text(json.dumps({"ref": args.ref, "runs": runs, "report": report}))
    if worse:
        print(f"\nlower by more than {args.threshold:.0%}: {', '.join(worse)}")
        return 1
    print(f"\nno figure lower by more than {args.threshold:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
