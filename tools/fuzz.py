"""Long fuzz runs of the default pipeline on random models (tests/kits/fuzzgen).

    python tools/fuzz.py 2000                    # 2000 examples, random seed
    python tools/fuzz.py 500 --seed 7 --out crashes/
    python tools/fuzz.py --replay crashes/<kind>  # re-run a saved case

Prints the count of each outcome: ok, QpassesError by message kind, crashes by kind. The first
crash of each kind is shrunk by hypothesis to a minimal model, saved to ``--out/<kind>/``
(model.onnx, config.json, feeds.npz, case.txt); later crashes of a known kind are only counted.
Exit status 1 if anything crashed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fuzz generators: tests.kits.fuzzgen
from tests.kits.fuzzgen.cases import FuzzCase, cases  # noqa: E402
from tests.kits.fuzzgen.outcome import no_floor_reasons, run_case  # noqa: E402


class _Crash(Exception):
    pass


class Fuzzer:
    def __init__(self, out: Path, max_ops: int, fail_on: str | None = None):
        self.out, self.max_ops, self.fail_on = out, max_ops, fail_on
        self.counts: collections.Counter = collections.Counter()
        self.examples: dict[str, str] = {}
        self.saved: dict[str, tuple[int, Path]] = {}   # crash kind -> (size, folder)
        self.snr: dict[str, list] = collections.defaultdict(list)
        self.done = 0
        self.target: str | None = None                 # crash kind being shrunk

    def body(self, case: FuzzCase) -> None:
        with _native_stderr_silenced():   # onnxruntime logs the load failures we provoke
            outcome = run_case(case)
        if self.fail_on and outcome.status == "error" and re.search(self.fail_on, outcome.detail):
            outcome.status = "crash"      # --fail-on: shrink and save these errors too
        if self.target is not None:                    # shrinking: only the target kind fails
            if outcome.status == "crash" and outcome.kind == self.target:
                self.save(case, outcome)
                raise _Crash(outcome.kind)
            return
        self.done += 1
        self.counts[(outcome.status, outcome.kind)] += 1
        self.examples.setdefault(outcome.kind, outcome.detail)
        if outcome.status == "ok" and outcome.snr:
            self.snr[_config_class(case)].append(min(outcome.snr.values()))
        if outcome.status == "crash" and outcome.kind not in self.saved:
            self.target = outcome.kind
            self.save(case, outcome)
            raise _Crash(outcome.kind)

    def save(self, case: FuzzCase, outcome) -> None:
        size = len(case.model.graph.node) + len(case.model.graph.initializer)
        if outcome.kind in self.saved and self.saved[outcome.kind][0] <= size:
            return
        folder = self.out / _slug(outcome.kind)
        folder.mkdir(parents=True, exist_ok=True)
        onnx.save(case.model, folder / "model.onnx")
        (folder / "config.json").write_text(json.dumps(case.config, indent=1))
        (folder / "meta.json").write_text(json.dumps({"traits": case.traits, "ops": case.ops, "passes": case.passes}))
        arrays = {f"{i}:{k}": v for i, f in enumerate(case.feeds) for k, v in f.items()}
        np.savez(folder / "feeds.npz", **arrays)
        (folder / "case.txt").write_text(f"{outcome.kind}\n{outcome.detail}\nconfig: {case.config}\n"
                                         f"ops: {case.ops}\n\n{onnx.printer.to_text(case.model)}\n")
        self.saved[outcome.kind] = (size, folder)

    def run(self, n: int, first_seed: int) -> None:
        run_seed = first_seed
        while self.done < n:
            self.target = None
            test = settings(max_examples=n - self.done, deadline=None, database=None,
                            phases=[Phase.generate, Phase.shrink], verbosity=Verbosity.quiet,
                            suppress_health_check=list(HealthCheck))(
                given(cases(max_ops=self.max_ops))(self.body))
            try:
                seed(run_seed)(test)()
            except _Crash:
                pass
            except Exception as exc:  # hypothesis reports a found failure as its own exception types
                if self.target is None:
                    raise
                del exc
            run_seed += 1
            print(f"  {self.done}/{n} examples", file=sys.stderr, flush=True)

    def report(self, seconds: float, first_seed: int) -> int:
        print(f"\n{self.done} examples in {seconds:.0f} s (seed {first_seed}, "
              f"{seconds / max(1, self.done):.2f} s each)")
        crashed = 0
        for status in ("ok", "skip", "error", "crash"):
            rows = [(k, v) for (s, k), v in self.counts.items() if s == status]
            total = sum(v for _, v in rows)
            print(f"{status}: {total}")
            crashed += total if status == "crash" else 0
            for kind, count in sorted(rows, key=lambda r: -r[1]):
                if kind == "ok":
                    continue
                where = f"  -> {self.saved[kind][1]}" if kind in self.saved else ""
                print(f"  {count:5d}  {kind}{where}")
                if status == "crash":
                    print(f"         {self.examples[kind][:300]}")
        print("min output SNR (dB) of ok cases, by config class: percentiles 0/1/5/50")
        for cls, values in sorted(self.snr.items()):
            finite = [v for v in values if not math.isinf(v)]
            pct = np.percentile(finite, [0, 1, 5, 50]) if finite else [math.inf] * 4
            print(f"  {cls:36s} n={len(values):5d}  " + "  ".join(f"{p:7.1f}" for p in pct))
        return 1 if crashed else 0


def _config_class(case: FuzzCase) -> str:
    """'floor' when the SNR floor applies, else the reasons it does not."""
    why = no_floor_reasons(case)
    return "floor" if not why else "no floor, 4-bit" if "4-bit" in why else "no floor, 8/16-bit"


def _slug(kind: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", kind).strip("-")[:80]


def replay(folder: Path) -> int:
    model = onnx.load(folder / "model.onnx")
    config = json.loads((folder / "config.json").read_text())
    data = np.load(folder / "feeds.npz")
    feeds: dict[int, dict] = collections.defaultdict(dict)
    for key in data.files:
        index, name = key.split(":", 1)
        feeds[int(index)][name] = data[key]
    meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").exists() else {}
    outcome = run_case(FuzzCase(model, [feeds[i] for i in sorted(feeds)], config, meta.get("ops", []),
                                meta.get("traits", []), meta.get("passes")))
    print(f"{outcome.status}: {outcome.kind}\n{outcome.detail}")
    return 1 if outcome.status == "crash" else 0


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 (C++ logging) to /dev/null for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _quiet_libraries() -> None:
    """onnxruntime and onnx-graphsurgeon log to stderr on the failures we provoke: silence them."""
    import onnxruntime as ort
    from onnx_graphsurgeon.logger import G_LOGGER

    ort.set_default_logger_severity(4)
    G_LOGGER.severity = G_LOGGER.CRITICAL + 10


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=1000, help="number of examples")
    parser.add_argument("--seed", type=int, default=None, help="first hypothesis seed (default: random)")
    parser.add_argument("--out", type=Path, default=Path("fuzz-crashes"),
                        help="folder for minimal crashing cases")
    parser.add_argument("--max-ops", type=int, default=16,
                        help="ops drawn per model (a few more nodes result)")
    parser.add_argument("--replay", type=Path, help="re-run a saved case folder")
    parser.add_argument("--fail-on", metavar="REGEX",
                        help="treat QpassesErrors whose message matches as crashes (to shrink and save them)")
    args = parser.parse_args(argv)
    _quiet_libraries()
    if args.replay:
        return replay(args.replay)
    first_seed = args.seed if args.seed is not None else random.randrange(2**32)
    fuzzer = Fuzzer(args.out, args.max_ops, args.fail_on)
    start = time.perf_counter()
    try:
        fuzzer.run(args.n, first_seed)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    return fuzzer.report(time.perf_counter() - start, first_seed)


if __name__ == "__main__":
    sys.exit(main())
