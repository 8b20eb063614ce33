"""The mp executor on two GPUs of one host (issue 15, item 1): greedy tokens of two ranks against
one, each rank on its own GPU, and a rank killed in the middle of a request.

    python3 bench/gpu_executor_check.py        # on nvidia-h200-x2; writes $OUT/gpu_executor.json

Random-weight Llama and Qwen3 (tests/tiny_models.py), fp32, the default engine arguments otherwise
(compiled, CUDA graphs, asynchronous scheduling): each rank holds half of every sharded layer and
the row-parallel layers' all-reduces run over NCCL inside the graphs.
"""

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import build_tiny_model  # noqa: E402

from kvik import LLM, SamplingParams  # noqa: E402
from kvik.executor import RankFailedError  # noqa: E402

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 13, 2, 7]}, {"prompt_token_ids": [3, 4]}]
ENGINE = dict(dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=256, max_num_seqs=8)


def greedy(llm: LLM, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def main() -> None:
    results: dict = {}
    folder = Path(tempfile.mkdtemp())
    for kind in ("llama", "qwen3"):
        model = str(build_tiny_model(kind, folder / kind))
        one = LLM(model, **ENGINE)
        expected = greedy(one)
        one.shutdown()
        del one
        started = time.monotonic()
        two = LLM(model, tensor_parallel_size=2, **ENGINE)
        start_s = time.monotonic() - started
        got = greedy(two)
        results[kind] = {
            "equal": got == expected,
            "start_s": round(start_s, 1),
            "rank0": two.engine.rank0,
            "rank_pids": two.engine.executor.rank_pids,
        }
        if kind == "llama":  # a rank killed mid-request
            engine, ranks = two.engine, two.engine.executor.rank_pids
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            _, ids, params = two.input_processor.process(PROMPTS[0], params)
            engine.add_request(two.input_processor.make_request("k", ids, params, 0, 0.0))
            for _ in range(3):
                engine.step()
            os.kill(ranks[1], signal.SIGKILL)
            killed = time.monotonic()
            error = None
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            except RankFailedError as e:
                error = str(e)
            alive = [p for p in ranks if Path(f"/proc/{p}").exists()]
            results["kill"] = {
                "error": error,
                "seconds": round(time.monotonic() - killed, 2),
                "alive_after": alive,
            }
        two.shutdown()
    print(json.dumps(results, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_executor.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
