"""What the server tests share: the tiny preset's checkpoint (the real vocabulary, so text round-trips), an
oracle LLM of its own (the server's backend belongs to the engine thread), and servers started on 127.0.0.1 on
a free port, stopped when the module's tests end. The API's and the errors' tests run twice: against an engine on a
thread of this process and against one in a process of its own."""

import functools

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.checkpoint import make_preset_checkpoint
from qwen_triton.config import load_config
from qwen_triton.engine.llm import ModelText
from qwen_triton.tokenizer import Tokenizer
from qwen_triton.server.app import create_app
from qwen_triton.server.engine_process import EngineProcess, load_llm_backend
from qwen_triton.server.runner import BackgroundServer

MAX_LENGTH = 256


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return make_preset_checkpoint("tiny", tmp_path_factory.mktemp("server") / "tiny", seed=1)


@functools.cache
def checkpoint_tokenizer(checkpoint) -> Tokenizer:
    """The checkpoint's tokenizer, read once (its 248k-token vocabulary takes seconds)."""
    return Tokenizer.from_checkpoint(checkpoint)


def load(checkpoint, max_batch: int = 4) -> LLM:
    return LLM(checkpoint, backend="reference", device="cpu", dtype=torch.float32, max_length=MAX_LENGTH,
               max_batch=max_batch, tokenizer=checkpoint_tokenizer(checkpoint))


@pytest.fixture(scope="session")
def oracle(checkpoint):
    """The same model outside the server: what each request must equal."""
    return load(checkpoint)


def start_server(checkpoint, max_num_seqs: int = 4, engine: str = "thread", drain_timeout: float = 30.0,
                 **options) -> BackgroundServer:
    """The tiny model served; engine "thread": on a thread of this process, "process": in an engine process of its
    own (server/engine_process.py), loaded there as `qwen-triton serve` loads it."""
    if engine == "thread":
        app = create_app(load(checkpoint, max_batch=max_num_seqs), model_name="tiny", drain_timeout=drain_timeout,
                         **options)
    else:
        engine_process = EngineProcess(
            functools.partial(load_llm_backend, dict(path=checkpoint, backend="reference", device="cpu",
                                                     dtype=torch.float32, max_length=MAX_LENGTH,
                                                     max_batch=max_num_seqs)),
            max_num_seqs=max_num_seqs, **options)
        engine_process.start(timeout=120)
        app = create_app(ModelText(checkpoint, load_config(checkpoint), checkpoint_tokenizer(checkpoint)),
                         scheduler=engine_process, model_name="tiny", drain_timeout=drain_timeout)
    return BackgroundServer(app).start()


@pytest.fixture(scope="module", params=["thread", "process"])
def server(checkpoint, request):
    """4 slots, 32 waiting, prompts prefilled 16 tokens a step; the engine on a thread, then in a process."""
    server = start_server(checkpoint, max_num_seqs=4, engine=request.param, max_queue=32, prefill_chunk=16)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scheduler(server):
    return server.app.state.scheduler
