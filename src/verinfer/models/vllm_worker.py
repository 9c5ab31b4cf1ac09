"""The vLLM side of ``--backend vllm``: final hidden states of token sequences, computed by vLLM itself.

Runs under the interpreter of an environment that has vLLM (``VERINFER_VLLM_PYTHON``), which need
not have verinfer: it imports only vLLM, numpy and the standard library, and is started by path.
vLLM loads the model as a pooling model that returns every token's last hidden state (the input to
``lm_head``, after the final norm), with its own kernels, executors and tensor parallelism; verinfer
applies the head. Protocol, one JSON object per line:

- stdin: ``{"sequences": [[ids], ...], "out": PATH}``; the worker writes the sequences' hidden
  states to PATH as one float32 array [sum of lengths, hidden] in their order;
- replies (on the file descriptor given by ``--reply-fd``): ``{"ready": true, "hidden": D}`` once
  loaded, then ``{"ok": true}`` or ``{"error": "..."}`` per request.

vLLM's own output (and its engine's subprocesses) goes to stderr, so replies never interleave with logs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _engine(args):
    from vllm import LLM
    from vllm.config import PoolerConfig

    kwargs = dict(model=args.model, dtype=args.dtype, seed=0, enforce_eager=True, enable_prefix_caching=False,
                  runner="pooling", convert="embed",
                  pooler_config=PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False))
    kwargs.update(json.loads(args.engine_args))  # the user's: tensor_parallel_size, gpu_memory_utilization, ...
    return LLM(**kwargs)


def _serve(llm, reply) -> None:
    import numpy as np
    from vllm.inputs import TokensPrompt

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in request["sequences"]]
            outputs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
            with open(request["out"], "wb") as fh:
                for seq, out in zip(request["sequences"], outputs):
                    data = out.outputs.data.float().cpu().numpy().astype(np.float32, copy=False)
                    if data.shape[0] != len(seq):
                        raise RuntimeError(f"vLLM returned {data.shape[0]} hidden states for {len(seq)} tokens")
                    data.tofile(fh)
            reply.write(json.dumps({"ok": True}) + "\n")
        except Exception as exc:  # the caller names the failure; the worker stays up for the next request
            reply.write(json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}) + "\n")
        reply.flush()


def parser() -> argparse.ArgumentParser:
    """The worker's arguments (a stand-in for tests takes the same)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--reply-fd", type=int, required=True)
    return ap


def main() -> int:
    args = parser().parse_args()
    reply = os.fdopen(args.reply_fd, "w")
    os.dup2(2, 1)  # vLLM prints to stdout; its subprocesses inherit this
    try:
        llm = _engine(args)
        hidden = int(llm.llm_engine.model_config.get_hidden_size())
    except Exception as exc:
        reply.write(json.dumps({"error": f"could not load the model: {type(exc).__name__}: {exc}"
                                .splitlines()[0]}) + "\n")
        reply.flush()
        return 1
    reply.write(json.dumps({"ready": True, "hidden": hidden}) + "\n")
    reply.flush()
    _serve(llm, reply)
    reply.close()
    shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(llm.llm_engine.engine_core, "shutdown", None)
    if shutdown is not None:
        shutdown()
    sys.stderr.flush()
    os._exit(0)  # interpreter teardown with vLLM's threads alive aborts ("terminate called ...")


if __name__ == "__main__":  # vLLM starts its engine core with spawn: nothing runs on import
    raise SystemExit(main())
