"""The OpenAI-compatible API over a real route, driven by the official `openai` client and, for
the SSE framing and error bodies, by plain HTTP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from dgr_cli.serve import served_name
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Draft, Route
from dgr_route.tokenizer import Tokenizer
from dgr_serve.inprocess import serving
from dgr_serve.openai_server import body_limit, create_app

N_CTX = 256
MODEL = "smollm2"


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Tokenizer:
    return Tokenizer(smollm2)


@pytest.fixture(scope="module")
def workers(smollm2: Path) -> Iterator[list[WorkerProcess]]:
    descriptor = descriptor_args(smollm2)
    started = [
        start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=N_CTX)
        for a, b in [(0, 15), (15, 30)]
    ]
    yield started
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def route(workers: list[WorkerProcess]) -> Iterator[Route]:
    r = Route.open([w.address for w in workers])
    yield r
    r.close()


@pytest.fixture(scope="module")
def base(route: Route, tokenizer: Tokenizer) -> Iterator[str]:
    with serving(create_app(route, tokenizer, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def sse(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, checking the framing on the way."""
    body = response.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "", "the stream must end with a complete event"
    out = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        out.append(event[len("data: ") :])
    return out


def test_models_and_health(client: openai.OpenAI, base: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert [s["layers"] for s in health["stages"]] == [[0, 15], [15, 30]]


def test_dgr_serve_names_the_model_by_the_heads_gguf(route: Route, smollm2: Path) -> None:
    """Without --model-name, /v1/models reports the head's GGUF file name less .gguf (the name
    `dgr artifacts fetch-model` gives it, which docs/usage.md's client example passes), not an
    arch and hash nobody can guess; every stage reports its own."""
    assert served_name(route) == smollm2.stem == "smollm2-135m-q4_1"
    assert [s.describe.model_name for s in route.stages] == [smollm2.stem] * 2


def test_dgr_serve_says_where_it_listens_or_why_it_cannot(workers: list[WorkerProcess]) -> None:
    """It printed nothing when serving, and a port in use was uvicorn's log line and exit 3."""
    import socket

    dgr = str(Path(sys.executable).with_name("dgr"))
    route = ",".join(w.address for w in workers)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [dgr, "serve", "--route", route, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert busy.returncode == 2, busy
    assert f"dgr serve: cannot listen on 127.0.0.1:{port}: [Errno 98]" in busy.stderr, busy.stderr
    proc = subprocess.Popen(
        [dgr, "serve", "--route", route, "--port", str(port), "--max-active", "9"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        said = proc.stderr.readline() + proc.stderr.readline()
        assert said == (
            f"dgr serve: http://127.0.0.1:{port}/v1 serves smollm2-135m-q4_1 over 2 stages: 9 "
            "request(s) at once, 16 queued\n"
            "dgr serve: note: --max-active 9 is more than the route's 4 session slots: requests "
            "past them are answered 429 by the stages' capacity\n"
        ), said
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m-q4_1"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_chat_completion_streams_the_same_text(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        seed=3,
        user="someone",
    )
    text = whole.choices[0].message.content or ""
    assert "Paris" in text and whole.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 3
    assert "".join(pieces) == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,  # type: ignore[union-attr]
        whole.usage.completion_tokens,  # type: ignore[union-attr]
    )
    assert all(c.usage is None for c in chunks[:-1])
    # the same prompt again: the stages kept all of it but its last token (computed for its
    # logits), and the text is the same bits as the full prefill's
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # type: ignore[union-attr]


def test_sse_framing_through_curl(client: openai.OpenAI, base: str) -> None:
    """What a plain SSE reader sees: `data: <json>` events, each ended by a blank line, the
    text equal to the non-streamed answer, then `data: [DONE]`."""
    curl = shutil.which("curl")
    assert curl is not None, "curl is in scripts/apt-packages.txt"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**body)  # type: ignore[call-overload]
    out = subprocess.run(
        [
            curl,
            "-sSN",
            "--fail-with-body",
            f"{base}/v1/completions",
            "-H",
            "content-type: application/json",
            "-d",
            json.dumps({**body, "stream": True}),
        ],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    assert out.endswith("data: [DONE]\n\n"), out[-200:]
    events = out.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason
    bad = subprocess.run(
        [
            curl,
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            f"{base}/v1/completions",
            "-H",
            "content-type: application/json",
            "-d",
            '{"model": "x", "prompt": "hi"}',
        ],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    assert bad == "404"


def test_completion_with_sampling(client: openai.OpenAI) -> None:
    greedy = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in greedy.choices[0].text
    assert greedy.usage is not None and greedy.usage.prompt_tokens > 3
    assert greedy.usage.completion_tokens == 8 and greedy.choices[0].finish_reason == "length"
    seeded = [
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=12,
            temperature=0.9,
            top_p=0.95,
            seed=7,
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == greedy.choices[0].text


def test_stop_sequences_across_tokens(client: openai.OpenAI) -> None:
    prompt = "Write the numbers from one to twenty in words, separated by commas:"
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, logprobs=0
    )
    text = free.choices[0].text
    assert free.choices[0].logprobs is not None
    tokens = free.choices[0].logprobs.tokens or []
    assert "".join(tokens) == text
    # a stop string that straddles two tokens, starting inside the first
    cut = len(tokens[0]) + len(tokens[1]) + len(tokens[2])
    stop = text[cut - 1 : cut + 2]
    assert len(stop) == 3 and stop.strip()
    expected = text[: text.index(stop)]
    for stream in (False, True):
        for stops in (stop, ["never-generated", stop]):
            got = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=40,
                temperature=0,
                stop=stops,
                stream=stream,
            )
            if stream:
                chunks = list(got)  # type: ignore[arg-type]
                assert "".join(c.choices[0].text for c in chunks) == expected
                assert chunks[-1].choices[0].finish_reason == "stop"
            else:
                assert got.choices[0].text == expected  # type: ignore[union-attr]
                assert got.choices[0].finish_reason == "stop"  # type: ignore[union-attr]
                assert got.usage.completion_tokens < 40  # type: ignore[union-attr]
    # a stop string that never completes: its held-back beginning goes out at the end
    tail = text[-1] + "\u2603"
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=tail, stream=True
    )
    chunks = list(got)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_context_limits(client: openai.OpenAI, tokenizer: Tokenizer, base: str) -> None:
    long_prompt = "hello " * N_CTX
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert (
        str(N_CTX) in body["message"] and str(len(tokenizer.encode(long_prompt))) in body["message"]
    )
    # max_tokens beyond the room left: capped, ends with "length"
    prompt = "The"
    room = N_CTX - len(tokenizer.encode(prompt))
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4096, temperature=0, stop=None
    )
    assert got.usage is not None
    finish = got.choices[0].finish_reason
    assert (finish == "length" and got.usage.completion_tokens == room) or finish == "stop"
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 4096,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.status_code == 200
        events = sse(response)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "error" not in last and last["choices"][0]["finish_reason"] in ("length", "stop")


def test_multilingual_text_is_whole(client: openai.OpenAI) -> None:
    for prompt in ("Привет! Как", "Καλημέρα! Πώς", "नमस्ते, आप", "你好，我的", "I love 🍕 and"):  # noqa: RUF001
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
            )
        )
        streamed = "".join(c.choices[0].text for c in chunks)
        assert streamed == whole.choices[0].text
        # a generation cut by max_tokens may end inside a character: only its last one, as the
        # whole sequence detokenized at once has it, may be U+FFFD
        if whole.choices[0].finish_reason == "length":
            streamed = streamed.removesuffix("\ufffd")
        assert "\ufffd" not in streamed, (prompt, streamed)


def test_openai_errors(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert isinstance(nf.value.body, dict) and nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "n"
    cases = [
        ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ({"prompt": "hi", "top_p": float("inf")}, "top_p"),
        ({"prompt": [1, 2, 49152]}, "prompt"),  # a token id past the vocabulary
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "hi", "top_k": 2**40}, "top_k"),  # past the wire's uint32
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "hi", "logprobs": 9}, "logprobs"),
        ({"prompt": ""}, "prompt"),
    ]
    for body, param in cases:
        raw = json.dumps({"model": MODEL, **body})  # NaN goes out as the bare token NaN
        r = httpx.post(
            f"{base}/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and param in (error["param"] or ""), error
        if isinstance(body.get("prompt"), list):
            assert "outside the vocabulary of 49152 tokens" in error["message"], error
        elif param in ("temperature", "top_p"):
            assert "finite number" in error["message"], error
    parts = [  # what is wrong, not pydantic's "content.str: Input should be a valid string"
        ([{"type": "image_url", "image_url": {"url": "x"}}], "content part 0 is 'image_url': only "
         "text parts are supported"),
        ([{"type": "text"}], "content part 0: a text part needs its text as a string"),
        ([{"type": "text", "text": "a", "x": 1}], "content part 0: unrecognized field(s) x"),
        (5, "content is int: a string or a list of parts"),
    ]  # fmt: skip
    prompts = [  # what is wrong, not pydantic's "prompt.str: Input should be a valid string"
        ([[1, 2], [3]], "one prompt per request: a list of token-id lists is a batch"),
        (["a", 1], "prompt mixes strings and token ids: one string, or token ids"),
        ([1, 2.5], "prompt item 1 is float: a prompt's list holds one string or token ids"),
        ([True], "prompt item 0 is bool"),
        ({"text": "hi"}, "prompt is dict: a string, a list of one string, or a list of token ids"),
    ]  # fmt: skip
    for prompt, message in prompts:
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and error["message"].startswith(f"prompt: {message}"), (
            error
        )
    for content, message in parts:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.0.content", error
        assert error["message"] == f"messages.0.content: {message}", error
    r = httpx.post(
        f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON"), r.text
    for body, kind in ((b"[]", "array"), (b'"hi"', "string"), (b"7", "number"), (b"null", "null")):
        r = httpx.post(
            f"{base}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
        # not pydantic's error dump with this server's source lines
        assert r.json()["error"]["message"] == f"the request body is a JSON {kind}, not an object"
    # a body past what the context could hold: 413 by its length, or once a chunked one passes
    # it (a 200 MB prompt was read whole, then the head's tokenizer's gRPC limit made it a 500)
    limit = body_limit(N_CTX)
    big = json.dumps({"model": MODEL, "prompt": "word " * (limit // 5 + 1)}).encode()
    r = httpx.post(
        f"{base}/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"] == (
        f"the request body is {len(big)} bytes: this server takes {limit} at most"
    )
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no Content-Length
    r = httpx.post(
        f"{base}/v1/completions", content=chunks, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "this server takes" in r.json()["error"]["message"], r.text
    r = httpx.get(f"{base}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_a_prompt_past_the_heads_message_limit_is_the_clients_400(smollm2: Path) -> None:
    """The head's tokenizer takes messages up to its --max-message-bytes: a text past that was
    its RESOURCE_EXHAUSTED, answered as this server's 500 "internal error"."""
    from dgr_route.tokenizer import tokenizer_for

    worker = start_worker(
        smollm2, 0, 30, descriptor=descriptor_args(smollm2), n_ctx=64, threads=1,
        extra=["--max-message-bytes", "1024"],
    )  # fmt: skip
    try:
        with Route.open([worker.address]) as route:
            app = create_app(route, tokenizer_for(None, route), MODEL)
            with serving(app) as url:
                body = {"model": MODEL, "prompt": "word " * 400, "max_tokens": 1}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "prompt", error
                assert error["message"].startswith("prompt: 2000 characters, too long to tokenize")
                ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}  # and it goes on serving
                assert httpx.post(f"{url}/v1/completions", json=ok, timeout=60).status_code == 200
    finally:
        worker.stop()


class BrokenTokenizer:
    """The real tokenizer but for encode, which fails as a defect of the server would."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.inner = tokenizer
        self.eog_ids, self.n_vocab = tokenizer.eog_ids, tokenizer.n_vocab

    def encode(self, text: str) -> list[int]:
        raise RuntimeError("tokenizer broke")

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_defect_of_the_server_is_still_an_openai_error(
    route: Route, tokenizer: Tokenizer
) -> None:
    with serving(create_app(route, BrokenTokenizer(tokenizer), MODEL)) as url:  # type: ignore[arg-type]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error", error
        assert error["message"] == "internal error: RuntimeError: tokenizer broke", error
        assert httpx.get(f"{url}/health").status_code == 200  # and it goes on serving


def test_logprobs_come_from_the_tail(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == got.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # greedy: the sampled token is the most likely one, with the logprob the tail reported
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(lps[0], abs=1e-4)


def test_mid_stream_failure_ends_with_an_error_event(smollm2: Path, tokenizer: Tokenizer) -> None:
    descriptor = descriptor_args(smollm2)
    ws = [
        start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=1024)
        for a, b in [(0, 15), (15, 30)]
    ]
    route = Route.open([w.address for w in ws], timeout=10)
    try:
        with serving(create_app(route, tokenizer, MODEL)) as url:
            request = {
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": 900,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=60) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                ws[1].proc.kill()  # the tail dies mid-generation
                rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
            assert rest[-1] == "[DONE]"
            error = json.loads(rest[-2])["error"]
            assert error["type"] == "server_error" and "stage 1" in error["message"], error
    finally:
        route.close()
        for w in ws:
            w.stop()


def test_a_stage_restarted_with_another_range_is_an_error_not_a_wrong_answer(
    smollm2: Path, tokenizer: Tokenizer
) -> None:
    """The tail restarted behind its address as [20, 30): completions went on (layers 15-19
    skipped). Now the completion is a 502 naming the change."""
    descriptor = descriptor_args(smollm2)
    head = start_worker(smollm2, 0, 15, descriptor=descriptor, n_ctx=N_CTX)
    tail = start_worker(smollm2, 15, 30, descriptor=descriptor, n_ctx=N_CTX)
    other = None
    route = Route.open([head.address, tail.address], timeout=10)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    try:
        with serving(create_app(route, tokenizer, MODEL)) as url:
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            tail.stop()
            other = start_worker(smollm2, 20, 30, descriptor=descriptor, port=tail.port)
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 502, r.text
            assert "stage changed: the route expects layers [15, 30)" in r.text, r.text
    finally:
        route.close()
        for w in (head, tail, other):
            if w is not None:
                w.stop()


def test_admission_queue_answers_429(route: Route, tokenizer: Tokenizer) -> None:
    with serving(create_app(route, tokenizer, MODEL, max_active=1, max_queue=1)) as url:
        long = {
            "model": MODEL,
            "prompt": "Once",
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
        }
        short = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it runs
            queued: list[httpx.Response] = []
            waiter = threading.Thread(
                target=lambda: queued.append(
                    httpx.post(f"{url}/v1/completions", json=short, timeout=60)
                )
            )
            waiter.start()
            deadline = time.monotonic() + 10
            while httpx.get(f"{url}/health").json()["waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = httpx.post(f"{url}/v1/completions", json=short, timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            for _ in lines:  # the first finishes; the queued one runs after it
                pass
        waiter.join(60)
        assert queued and queued[0].status_code == 200
        assert httpx.get(f"{url}/health").json()["running"] == 0


def test_drafted_completions_report_accepted_predictions(
    client: openai.OpenAI, workers: list[WorkerProcess], tokenizer: Tokenizer
) -> None:
    """`dgr serve --draft lookup`: the same text as plain decode, and the usage counts the
    drafts the route kept and rejected in OpenAI's fields for predicted tokens."""
    quote = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins."
    prompt = f"Repeat the following text exactly.\n\n{quote}\n\nRepeated text:\n"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    drafted_route = Route.open([w.address for w in workers], draft=Draft("lookup"))
    try:
        with serving(create_app(drafted_route, tokenizer, MODEL)) as url:
            drafted_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            got = drafted_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0
            )
    finally:
        drafted_route.close()
    assert got.choices[0].text == plain.choices[0].text
    details = got.usage.completion_tokens_details if got.usage else None
    assert details is not None and (details.accepted_prediction_tokens or 0) > 0
    assert details.rejected_prediction_tokens is not None


def test_health_answers_with_64_queued_and_a_disconnect_frees_its_slot(
    route: Route, tokenizer: Tokenizer
) -> None:
    """Requests waiting for admission wait on the event loop: /health answers in well under
    100 ms with 64 of them queued behind one running; a client that goes away mid-stream has its
    slot passed on within a second; /metrics has the TTFT and per-token histograms."""
    app = create_app(route, tokenizer, MODEL, max_active=1, max_queue=64)
    with serving(app) as url:
        long = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "temperature": 0}
        short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=60
        ) as first:
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it runs
            waiters = [
                threading.Thread(
                    target=lambda: httpx.post(f"{url}/v1/completions", json=short, timeout=120),
                    daemon=True,
                )
                for _ in range(64)
            ]
            for w in waiters:
                w.start()
            deadline = time.monotonic() + 20
            while httpx.get(f"{url}/health").json()["waiting"] < 64:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
                times.append(time.perf_counter() - t0)
            assert max(times) < 0.1, f"/health took up to {max(times) * 1000:.0f} ms"
            refused = httpx.post(f"{url}/v1/completions", json=short, timeout=60)
            assert refused.status_code == 429
        gone = time.monotonic()  # the running stream's client left: the queue moves
        while httpx.get(f"{url}/health").json()["waiting"] > 63:
            assert time.monotonic() - gone < 1.0, "the disconnected stream kept its slot"
            time.sleep(0.02)
        for w in waiters:
            w.join(120)
        health = httpx.get(f"{url}/health").json()
        assert health["running"] == 0 and health["waiting"] == 0
        text = httpx.get(f"{url}/metrics").text
        assert "dgr:time_to_first_token_seconds_count 65.0" in text
        assert "dgr:time_per_output_token_seconds_count" in text
