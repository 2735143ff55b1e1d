"""A Hugging Face model with its own tensor-parallel plan (``tp_plan="auto"``) under geoscale.

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 -m bench.hf_tp_plan

transformers initializes the process group (gloo on CPU), shards q/k/v colwise and o
rowwise by the model's ``base_model_tp_plan`` and computes with the local shards
(``W.to_local()``). Every rank then prints its own heads' scales next to the scales one
process computes for the same checkpoint (a tiny Llama, GQA 4/2, seeded: every rank saves the
same one, as the group does not exist before ``from_pretrained``).
"""
from __future__ import annotations

import os
import tempfile

import torch
from tabulate import tabulate


def _checkpoint(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128,
                                   vocab_size=128, max_position_embeddings=64,
                                   attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def main() -> None:
    import torch.distributed as dist
    import transformers

    import geoscale_fx

    transformers.utils.logging.disable_progress_bar()
    path = os.path.join(tempfile.gettempdir(),
                        f"geoscale_hf_tp_plan_{os.environ.get('RANK', '0')}")
    _checkpoint(path)
    tp = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    rank = dist.get_rank()                # transformers initialized the group
    single = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ours = geoscale_fx.wrap(tp, compiler="aot_eager")
    reference = geoscale_fx.wrap(single, compiler="aot_eager")
    with torch.no_grad():
        diff = (ours(x).logits - reference(x).logits).abs().max().item()
    rows = []
    for key, record in ours.geoscale.records.items():
        shard = record.site.shard
        full = reference.geoscale.records[key.rsplit("_tp", 1)[0]].state.scale
        rows.append([rank, key, shard.label if shard else "-",
                     record.state.scale.tolist(), full[list(shard.q_heads)].tolist()
                     if shard else full.tolist()])
    for turn in range(dist.get_world_size()):
        if turn == rank:
            print(f"rank {rank}: max |logits - one process| = {diff:.2e}; sites left as is: "
                  f"{len(ours.geoscale.skipped)}")
            print(tabulate(rows, headers=["rank", "state key", "heads", "scale (this rank)",
                                          "scale (one process, same heads)"]), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
