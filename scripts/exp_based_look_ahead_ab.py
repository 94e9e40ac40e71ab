"""Based engine decode tokens/s with run_batched's look-ahead off and on, alternating in one process."""
import json, os, sys
sys.path[:0] = [".", "scripts"]
import torch  # noqa: E402
import gpu_lesson08_memory as m  # noqa: E402  (sets YAIE_SOLUTIONS=all)
import yaie.engine.sequential as seq  # noqa: E402
from yaie.engine.llm import LLM  # noqa: E402

dev = os.environ.get("AB_DEVICE", "cuda")
lengths = [int(x) for x in os.environ.get("AB_LENGTHS", "1024,16384").split(",")]
steps = int(os.environ.get("AB_STEPS", "64"))
if dev == "cpu":
    from yaie.device import prepare_triton
    prepare_triton()
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
llm = LLM("yaie/assets/tiny-based", device=dev)
out = dict(commit=os.environ.get("YAIE_GIT_COMMIT"), gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           torch=torch.__version__, decode_steps=steps, cuda_graphs=llm.cuda_graphs, rounds=[])
for _ in range(2):
    for la in (False, True):
        seq.run_batched.__defaults__ = (la,)
        sp = m.engine_decode_speed(llm, lengths, [1, 16], steps, sync, f"based look_ahead={la}")
        out["rounds"].append(dict(look_ahead=la, rows=[dict(prompt_tokens=n, batch=b, tokens_per_s=v)
                                                       for (n, b), v in sp.items()]))
with open(os.path.join(os.environ.get("OUT", "."), "lesson08_based_look_ahead_ab.json"), "w") as f:
    json.dump(out, f, indent=2)
