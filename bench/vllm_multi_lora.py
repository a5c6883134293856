"""Runs inside the vLLM venv (see bench/setup_vllm.sh): reads a job as JSON on stdin, prints tokens/s as JSON.

Not imported by Loom; bench/multi_lora.py starts it with ``--vllm-python``.
"""

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    names = sorted(job["adapters"])
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        enable_lora=True,
        max_loras=len(names),
        max_lora_rank=64,
        max_model_len=2048,
        gpu_memory_utilization=0.3,  # on CPU this is the share of host memory vLLM reserves
    )
    ids = {n: i + 1 for i, n in enumerate(names)}
    reqs = [None if lo is None else LoRARequest(lo, ids[lo], job["adapters"][lo]) for lo in job["loras"]]
    sp = SamplingParams(temperature=0, max_tokens=job["new_tokens"], min_tokens=job["new_tokens"], ignore_eos=True)
    llm.chat(job["prompts"][:1], sp)  # warm-up
    t = time.perf_counter()
    outs = llm.chat(job["prompts"], sp, lora_request=reqs)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"tokens_per_s": n / (time.perf_counter() - t)}))


if __name__ == "__main__":
    main()
