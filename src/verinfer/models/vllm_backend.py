"""``--backend vllm``: the reference's hidden states computed by vLLM itself, the head applied here.

The transformers backend is exact on one device and cannot hold a 70B model; vLLM, the engine users
already run, shards it across GPUs with its own kernels and executors. vLLM loads the model as a
pooling model and returns every token's final normed hidden state (``vllm_worker``, run under
vLLM's own interpreter); verinfer applies ``lm_head`` (and a final soft-cap) to the rows it scores,
in the reference dtype, so scoring, filters and Gumbel replay are the same code as with transformers.
Only prefills are served: replays that decode with a KV cache (speculative decoding, ``diagnose``'s
model variants) need the transformers backend.

Spec: ``vllm`` or ``vllm:KEY=VALUE,...`` with vLLM engine arguments (``tensor_parallel_size=4``,
``gpu_memory_utilization=0.8``, ``max_model_len=8192``). The interpreter is ``$VERINFER_VLLM_PYTHON``,
else this one when it imports vLLM.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from verinfer.models.backend import Backend, parse_dtype
from verinfer.models.load import ModelNotAvailable, ReferenceFailed, local_dir, resolve, with_chat_template

WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "VERINFER_VLLM_PYTHON"
DERIVED_NEED_TRANSFORMERS = ("--variants and the model search build derived copies of the model: they need "
                             "--backend transformers")
LOAD_TIMEOUT_S = float(os.environ.get("VERINFER_VLLM_LOAD_TIMEOUT", 1800))


def engine_args(spec: str) -> dict:
    """vLLM engine arguments from ``vllm:KEY=VALUE,...`` (values read as JSON where they parse)."""
    name, _, rest = spec.partition(":")
    if name != "vllm":
        raise ValueError(f"unknown backend {spec!r}: use transformers, or vllm[:KEY=VALUE,...]")
    args: dict = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"backend {spec!r}: {item!r} is not KEY=VALUE (e.g. vllm:tensor_parallel_size=2)")
        try:
            args[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            args[key.strip()] = value
    return args


def check_with_ray(use_ray: bool, backend: str) -> None:
    """Ray replicas are transformers models; vLLM shards one model across GPUs itself."""
    if use_ray and backend != "transformers":
        raise ValueError("--ray runs transformers replicas; --backend vllm spreads one model across GPUs itself "
                         "(tensor_parallel_size): use one or the other")


def vllm_python() -> str:
    """The interpreter that runs vLLM: ``$VERINFER_VLLM_PYTHON``, else this one if it has vLLM."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        if not os.access(given, os.X_OK):
            raise ValueError(f"{PYTHON_ENV}={given}: not an executable interpreter")
        return given
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--backend vllm: vLLM is not installed in this environment; install it here or set "
                         f"{PYTHON_ENV} to the python of an environment that has it")
    return sys.executable


class VllmWorker:
    """One vLLM process computing final hidden states; requests and replies one line each."""

    def __init__(self, python: str, model: str, dtype: str, args: dict):
        self.scratch = Path(tempfile.mkdtemp(prefix="verinfer-vllm-"))
        self.log_path = self.scratch / "vllm.log"
        read_fd, write_fd = os.pipe()
        cmd = [python, str(WORKER), "--model", model, "--dtype", dtype, "--engine-args", json.dumps(args),
               "--reply-fd", str(write_fd)]
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                         pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")
        self.model, self._requests, self._failed = model, 0, False
        atexit.register(self.close)
        ready = self._reply(LOAD_TIMEOUT_S, "loading")
        self.hidden_size = int(ready["hidden"])

    def _failure(self, what: str) -> ReferenceFailed:
        self._failed = True  # its log is kept
        tail = [line for line in self.log_path.read_text(errors="replace").splitlines() if "Error" in line]
        last = tail[-1].strip() if tail else "see the log"
        return ReferenceFailed(f"vLLM worker for {self.model} failed while {what}: {last} (log: {self.log_path})")

    def _reply(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self._replies], [], [], 1.0)
            if ready:
                line = self._replies.readline()
                if not line:
                    raise self._failure(what)
                reply = json.loads(line)
                if "error" in reply:
                    self._failed = True
                    raise ReferenceFailed(f"vLLM worker for {self.model}: {reply['error']} (log: {self.log_path})")
                return reply
            if self.proc.poll() is not None:
                raise self._failure(what)
            if time.monotonic() > deadline:
                self._failed = True
                self.close()
                raise ReferenceFailed(f"vLLM worker for {self.model}: no reply after {timeout_s:.0f} s while "
                                      f"{what} (log: {self.log_path})")

    def hidden(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each sequence's final hidden states [len, D] in fp32, from one vLLM ``encode`` call."""
        if self.proc.poll() is not None:
            raise self._failure("serving")
        self._requests += 1
        out = self.scratch / f"hidden-{self._requests}.f32"
        request = {"sequences": [[int(t) for t in s] for s in sequences], "out": str(out)}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died since the last reply
            raise self._failure("serving") from None
        self._reply(LOAD_TIMEOUT_S, f"prefilling {sum(map(len, sequences))} tokens")
        flat = torch.from_numpy(np.fromfile(out, dtype=np.float32)).view(-1, self.hidden_size)
        out.unlink()
        return list(flat.split([len(s) for s in sequences]))

    def close(self) -> None:
        """Stop the engine (it exits when its input closes) and remove the scratch files."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._replies.close()
        if not self._failed:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _snapshot(source) -> Path:
    """The local directory of a model: converted GGUF, a local directory, or a hub id's cached snapshot."""
    path = local_dir(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(source.path), local_files_only=True))


def _head(directory: Path, config, dtype: torch.dtype) -> torch.Tensor:
    """The output embedding's weight [V, D], read alone from the checkpoint (a tied head is the input
    embedding): the whole model is never loaded on this side."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    weight = skeleton.get_output_embeddings().weight
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is weight]
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            for name in names:
                if name in fh.keys():
                    return fh.get_tensor(name).to(dtype)
    raise ModelNotAvailable(f"{directory}: no {' or '.join(names)} tensor in its safetensors files")


class VllmBackend(Backend):
    """A reference whose hidden states come from vLLM: prefills only (``sequence_hidden``)."""

    decodes = False
    reference_name = "vllm"

    def __init__(self, worker: VllmWorker, head: torch.Tensor, tokenizer, config, generation_eos, model_id: str,
                 dtype: torch.dtype, device: str = "cpu"):
        self.worker, self.model, self._eos = worker, None, generation_eos
        self._setup(tokenizer, config, model_id, dtype, torch.device(device), int(head.shape[0]))
        self.head = head.to(self.device)

    @classmethod
    def load(cls, spec: str, dtype: str | torch.dtype = torch.float32, device: str = "cpu",
             args: dict | None = None) -> "VllmBackend":
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        source = resolve(spec)
        dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        directory = _snapshot(source)
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        tokenizer = with_chat_template(AutoTokenizer.from_pretrained(str(directory), local_files_only=True),
                                       config.model_type)
        try:
            eos = GenerationConfig.from_pretrained(str(directory), local_files_only=True).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's EOS alone
            eos = None
        head = _head(directory, config, dt)
        worker = VllmWorker(vllm_python(), str(directory), str(dt).removeprefix("torch."), args or {})
        return cls(worker, head, tokenizer, config, eos, source.model_id, dt, device)

    def _generation_eos(self) -> int | list[int] | None:
        return self._eos

    def hidden(self, *args, **kwargs):
        raise ValueError("--backend vllm computes prefills only; generating, serving, speculative decoding and "
                         "diagnose's model variants decode with a KV cache: use --backend transformers")

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head`` as a bias-free linear map in the reference dtype, as transformers applies it."""
        return torch.nn.functional.linear(hidden, self.head)

    def sequence_hidden(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return [h.to(self.device) for h in self.worker.hidden(sequences)]
