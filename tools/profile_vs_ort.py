#!/usr/bin/env python
"""Where one ONNX model spends its time against another, per op type and per node, from onnxruntime's
own profiler (CPU, 1 intra-op thread, ORT_ENABLE_ALL, the models' runs interleaved).

    python tools/profile_vs_ort.py ours.onnx ort_qdq.onnx --feeds eval.npz [--runs 50] [--top 15]

Prints, for each op type onnxruntime ran (after its fusions), the ms per run and node count of each
model, then the nodes whose time differs most: a node is matched across the models by the source node
it came from (read off the names onnxruntime gives fused and re-laid-out nodes and the Q/DQ nodes a
quantizer inserted), so a Conv left float in one model lines up with the QLinearConv it became in the
other and a Q/DQ pair with the node that makes its tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

# what onnxruntime appends to the name of a node it made (fusions, NCHWc layout) or to a tensor's
# name for the Q/DQ nodes a quantizer inserted
_SUFFIX = re.compile(r"(_token_\d+|_nchwc|_q|_dq|_QuantizeLinear|_DequantizeLinear|/.*)$")


def first_feed(path: Path | None, session) -> dict:
    """Sample 0 of an ``.npz`` of stacked feeds (``name -> [N, ...]``), else zeros of the inputs' shapes."""
    if path is not None:
        data = np.load(path)
        return {k: data[k][0] for k in data.files}
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    return {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], types.get(i.type, np.float32))
            for i in session.get_inputs()}


def profile(paths: list[Path], feed_path: Path | None, runs: int, workdir: str) -> list[list[dict]]:
    """The profiler's node events of each model (``op``, ``node``, ``us``) over ``runs`` interleaved runs."""
    import onnxruntime as ort

    sessions = []
    for k, path in enumerate(paths):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(workdir, f"m{k}")
        opts.log_severity_level = 3
        sessions.append(ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]))
    feed = first_feed(feed_path, sessions[0])
    for s in sessions:
        s.run(None, feed)   # warm-up; its events are dropped below (first run)
    for _ in range(runs):
        for s in sessions:
            s.run(None, feed)
    events = []
    for s in sessions:
        trace = json.loads(Path(s.end_profiling()).read_text())
        nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        per_run = len(nodes) // (runs + 1)
        events.append([{"op": e["args"].get("op_name", "?"), "node": e["name"][:-len("_kernel_time")],
                        "us": float(e["dur"])} for e in nodes[per_run:]])
    return events


def by_op(events: list[dict], runs: int) -> dict[str, tuple[float, int]]:
    """op type -> (ms per run, nodes)."""
    ms, nodes = defaultdict(float), defaultdict(set)
    for e in events:
        ms[e["op"]] += e["us"] / 1000.0 / runs
        nodes[e["op"]].add(e["node"])
    return {op: (ms[op], len(nodes[op])) for op in ms}


def source_names(path: Path) -> dict[str, str]:
    """Tensor name -> the name of the model's node that makes it."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return {out: node.name for node in graph.node for out in node.output if node.name}


def by_source(events: list[dict], runs: int, maker: dict[str, str]) -> dict[str, tuple[float, str]]:
    """source node name -> (ms per run, op types run for it): a run node's name without what onnxruntime
    appended, or, where that names a tensor (``877_nchwc``, ``503_QuantizeLinear``), its maker."""
    ms, ops = defaultdict(float), defaultdict(set)
    for e in events:
        key = _SUFFIX.sub("", e["node"])
        key = maker.get(key, key)
        ms[key] += e["us"] / 1000.0 / runs
        ops[key].add(e["op"])
    return {k: (ms[k], "+".join(sorted(ops[k]))) for k in ms}


def report(labels: list[str], events: list[list[dict]], makers: list[dict], runs: int, top: int) -> str:
    ops = [by_op(e, runs) for e in events]
    names = sorted(set().union(*ops), key=lambda o: -max(t.get(o, (0, 0))[0] for t in ops))
    head = " | ".join(f"{lab} ms (nodes)" for lab in labels)
    lines = [f"| op type | {head} |", "|---|" + "---|" * len(labels)]
    for op in names:
        lines.append(f"| {op} | " + " | ".join(f"{t[op][0]:.2f} ({t[op][1]})" if op in t else "-" for t in ops) + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(v[0] for v in t.values()):.2f}**" for t in ops) + " |")
    if len(events) >= 2:
        a, b = (by_source(e, runs, m) for e, m in zip(events[:2], makers))
        diff = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0,))[0] - b.get(k, (0,))[0]))
        lines += ["", f"| node (source name) | {labels[0]} ms | op | {labels[1]} ms | op | diff ms |",
                  "|---|---|---|---|---|---|"]
        for k in diff[:top]:
            (ta, oa), (tb, ob) = a.get(k, (0.0, "-")), b.get(k, (0.0, "-"))
            lines.append(f"| {k} | {ta:.3f} | {oa} | {tb:.3f} | {ob} | {ta - tb:+.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help="ONNX models; the first two are compared node by node")
    ap.add_argument("--labels", help="comma list, one per model (default: file stems)")
    ap.add_argument("--feeds", type=Path, help=".npz of stacked feeds; sample 0 is run (default: zeros)")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--top", type=int, default=15, help="nodes listed in the node table")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [p.stem for p in args.models]
    missing = [str(p) for p in args.models if not p.is_file()] + ([str(args.feeds)] if args.feeds and not args.feeds.is_file() else [])
    if missing or len(labels) != len(args.models) or args.runs < 1:
        print(f"profile_vs_ort: {'no such file: ' + missing[0] if missing else 'one label per model, runs >= 1'}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        events = profile(args.models, args.feeds, args.runs, workdir)
    print(report(labels, events, [source_names(p) for p in args.models], args.runs, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
