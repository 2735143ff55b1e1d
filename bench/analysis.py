"""Time of the analysis pass on the Dynamo graph of a 32-layer Llama-2-7B-shaped model.

The model is built on the meta device (no weights); the graph is captured once with
``capture_graphs`` (Dynamo's own time, reported separately) and ``analyze_graph`` is timed
on it (median of repeats). Target: under 1 s. Run ``python -m bench.analysis``.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch
from tabulate import tabulate

from bench.timing import median_seconds
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph

log = logging.getLogger("bench.analysis")


def llama2_7b_meta(n_layers: int = 32):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=n_layers, num_attention_heads=32,
                                   num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def measure(seq_len: int, batch: int, repeats: int) -> dict:
    model = llama2_7b_meta()
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    start = time.perf_counter()
    graphs = capture_graphs(model, input_ids=ids, use_cache=False)
    capture_s = time.perf_counter() - start
    graph = graphs[0]
    sites = analyze_graph(graph.gm, graph.example_inputs)
    analysis_s = median_seconds(lambda: analyze_graph(graph.gm, graph.example_inputs),
                                repeats=repeats, warmup=1)
    return {"batch": batch, "seq_len": seq_len, "graphs": len(graphs),
            "nodes": len(graph.gm.graph.nodes), "sites": len(sites),
            "supported": sum(s.supported for s in sites), "capture_s": capture_s,
            "analysis_s": analysis_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.analysis", description=__doc__)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = [measure(length, args.batch, args.repeats) for length in args.seq_len]
    print("Llama-2-7B shape (32 layers, d=4096, 32 heads), meta device, torch "
          f"{torch.__version__}")
    print(tabulate([[r["batch"], r["seq_len"], r["nodes"], f"{r['supported']}/{r['sites']}",
                     f"{r['capture_s']:.1f}", f"{r['analysis_s']:.3f}",
                     "yes" if r["analysis_s"] < 1.0 else "NO"] for r in rows],
                   headers=["batch", "seq len", "graph nodes", "supported/sites",
                            "Dynamo capture s", "analysis s", "< 1 s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
