"""Run independent check sections in one GPU call: a failure is recorded and the next section still runs."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch


def run_sections(sections: list, device: str, out_file: Path, print_chars: int = 2000) -> int:
    """Run ``(name, fn)`` pairs, print each result, write all to ``out_file`` as JSON; 1 if any failed."""
    import transformers

    report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                  transformers=transformers.__version__)
    failed = False
    for name, fn in sections:
        try:
            report[name] = dict(ok=True, result=fn())
        except Exception as err:  # record and go on: one GPU call must tell everything
            failed = True
            report[name] = dict(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        print(name, json.dumps(report[name], default=str)[:print_chars], flush=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 1 if failed else 0
