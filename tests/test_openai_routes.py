"""`rlorch serve`'s OpenAI-compatible routes, driven by the official `openai` client, and the pure
request/response/tool-call module behind them (rlorch.openai_api)."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import pytest

from rlorch.openai_api import (ApiError, ChatChoice, chat_completion_body, chat_completion_chunks, parse_chat_request,
                               parse_completion_request, parse_tool_calls, sse)
from rlorch.serve.server import CpuServer, ServerThread

openai = pytest.importorskip("openai")

CALCULATE = {"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "required": ["key"]}}}
USER = [{"role": "user", "content": "12+3="}]


@pytest.fixture(scope="module")
def server(model_dir):
    thread = ServerThread(CpuServer(model_dir, threads=1, tool_call_parser="pipe"))
    yield thread.address
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain_server(model_dir, tmp_path_factory):
    """The tiny model without a chat template, served with no tool-call parser."""
    bare = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(model_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config_file = bare / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    thread = ServerThread(CpuServer(bare, threads=1, min_step_time=0.02))
    yield thread.address
    thread.stop()


def post(address: str, path: str, raw: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address}{path}", data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ---- completions ----------------------------------------------------------------------------

def test_completion_logprobs_are_the_numbers_generate_reports(client, server):
    ids = [1, 5, 6, 16, 7, 17]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=0)
    status, native = post(server, "/generate", json.dumps({
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).encode())
    assert status == 200
    choice = out.choices[0]
    assert choice.logprobs.token_logprobs == [entry[0] for entry in native["meta_info"]["output_token_logprobs"]]
    assert choice.text == native["text"]
    assert choice.finish_reason == native["meta_info"]["finish_reason"]["type"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(native["output_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_text_prompt_is_encoded_as_generate_encodes_text(client, server):
    out = client.completions.create(model="tiny", prompt="12+3=", max_tokens=5, temperature=0, logprobs=2)
    _, native = post(server, "/generate", json.dumps({
        "text": "12+3=", "return_logprob": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).encode())
    logprobs = out.choices[0].logprobs
    assert out.usage.prompt_tokens == 6  # <bos> and five characters
    assert logprobs.token_logprobs == [entry[0] for entry in native["meta_info"]["output_token_logprobs"]]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert [max(top, key=top.get) for top in logprobs.top_logprobs] == logprobs.tokens  # greedy: the best is taken
    assert logprobs.text_offset == list(range(len(logprobs.tokens)))


def test_completions_n_and_a_batch_of_prompts_answer_prompt_major(client):
    out = client.completions.create(model="tiny", prompt=["1+1=", "22+2="], n=2, max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 + 6
    assert out.usage.completion_tokens <= 12
    default = client.completions.create(model="tiny", prompt=[[1, 5]], n=1)
    assert default.usage.completion_tokens <= 16 and default.model == "tiny"


def test_sglang_extras_ignore_eos_and_top_k(client):
    long = client.completions.create(model="tiny", prompt="1", max_tokens=40, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40 and long.choices[0].finish_reason == "length"
    greedy = client.completions.create(model="tiny", prompt="1", max_tokens=6, temperature=0)
    top1 = client.completions.create(model="tiny", prompt="1", max_tokens=6, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text


def test_echo_puts_the_prompt_first(client):
    out = client.completions.create(model="tiny", prompt="7+7=", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="7+7=", max_tokens=3, temperature=0)
    assert out.choices[0].text == "7+7=" + plain.choices[0].text


def test_stop_cuts_the_text_and_answers_stop(client):
    full = client.completions.create(model="tiny", prompt="12+3=", max_tokens=8, temperature=0).choices[0]
    assert len(full.text) >= 3, full
    stop = full.text[2]
    cut = client.completions.create(model="tiny", prompt="12+3=", max_tokens=8, temperature=0, stop=[stop, "zz"])
    assert cut.choices[0].text == full.text[:full.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


# ---- chat -----------------------------------------------------------------------------------

def test_chat_renders_the_template_and_answers_the_chat_shape(client, server):
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    # <bos>user:12+3=<eos>assistant:
    assert out.usage.prompt_tokens == 1 + len("user:12+3=") + 1 + len("assistant:")
    _, native = post(server, "/generate", json.dumps({
        "text": "user:12+3=<eos>assistant:", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).encode())
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == native["text"] and not message.tool_calls
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    parts = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "3="}]}])
    assert parts.choices[0].message.content == message.content


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=5, max_tokens=50,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5, "max_completion_tokens wins over max_tokens"
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v < 0 for v in values)
        assert bytes(entry.bytes).decode() == entry.token
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_n_and_seed(client):
    def ask(seed: int, n: int = 3):
        out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, n=n, seed=seed)
        return [c.message.content for c in out.choices]

    first = ask(11)
    assert len(first) == 3 and ask(11) == first, "the same seed draws the same samples"
    assert ask(12) != first
    assert len(set(first)) > 1, "the n samples of one request draw apart"


def test_tool_calls_with_the_pipe_parser(client):
    """A seeded request with and without tools draws the same texts: where the text has a `|`, the
    tool request answers the call before it; elsewhere the same text as content."""
    def ask(**extra):
        return client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, n=12, seed=3,
                                              temperature=1.0, **extra).choices

    texts = [c.message.content for c in ask()]
    called = ask(tools=[CALCULATE])
    assert any("|" in text for text in texts), "seed 3 should write a call somewhere (pick another seed)"
    for text, choice in zip(texts, called):
        if "|" in text:
            (call,) = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert call.type == "function" and call.function.name == "calculate"
            assert json.loads(call.function.arguments) == {"expression": text[:text.index("|")]}
            assert call.id.startswith("call_") and len(call.id) == 5 + 24
        else:
            assert choice.message.tool_calls is None and choice.message.content == text
    ignored = ask(tools=[CALCULATE], tool_choice="none")
    assert [c.message.content for c in ignored] == texts


def test_without_a_parser_tools_are_ignored(plain_server):
    client = openai.OpenAI(base_url=f"http://{plain_server}/v1", api_key="unused", max_retries=0)
    status, body = post(plain_server, "/v1/completions", json.dumps(
        {"prompt": "1|", "max_tokens": 3}).encode())
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=USER, tools=[CALCULATE])
    assert err.value.param == "messages" and "chat template" in err.value.message


def collect(stream) -> tuple[dict, dict, dict, dict, list]:
    """Per choice index: the text, the finish reason, the tool calls and the logprobs a chat
    stream sent; and the chunks' usage (None but the last)."""
    texts, finishes, calls, logprobs, usages = {}, {}, {}, {}, []
    for chunk in stream:
        usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                calls.setdefault(choice.index, []).append(call)
            if choice.logprobs is not None:
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.content)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, calls, logprobs, usages


def test_streaming_sends_tokens_as_they_come_and_reassembles_the_same_answer(client):
    request = dict(model="tiny", messages=USER, max_tokens=10, n=2, seed=5, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    texts, finishes, _, logprobs, usages = collect(chunks)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert [finishes[0], finishes[1]] == [c.finish_reason for c in whole.choices]
    for index, choice in enumerate(whole.choices):
        assert [(e.token, e.logprob, len(e.top_logprobs)) for e in logprobs[index]] == [
            (e.token, e.logprob, 2) for e in choice.logprobs.content]
    assert usages[:-1] == [None] * (len(usages) - 1) and usages[-1].total_tokens == whole.usage.total_tokens
    content_chunks = [c for c in chunks if c.choices and c.choices[0].index == 0 and c.choices[0].delta.content]
    assert len(content_chunks) > 1, "tokens are sent as they come, not all at the end"


def test_streamed_text_never_sends_what_a_stop_string_cuts(client):
    full = client.completions.create(model="tiny", prompt="12+3=", max_tokens=8, temperature=0).choices[0].text
    for stop in (full[2], full[1:3], full[2] + "never"):
        request = dict(model="tiny", prompt="12+3=", max_tokens=8, temperature=0, stop=stop)
        whole = client.completions.create(**request).choices[0]
        streamed = list(client.completions.create(**request, stream=True))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.text, stop
        assert streamed[-1].choices[0].finish_reason == whole.finish_reason
    echoed = client.completions.create(model="tiny", prompt="5+5=", max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, stream=True)
    chunks = [c.choices[0] for c in echoed]
    assert "".join(c.text for c in chunks) == "5+5=" + client.completions.create(
        model="tiny", prompt="5+5=", max_tokens=4, temperature=0).choices[0].text
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == list(range(4, 4 + len(offsets)))


def test_streamed_tool_calls_match_the_whole_answer(client):
    request = dict(model="tiny", messages=USER, max_tokens=20, n=12, seed=3, tools=[CALCULATE])
    whole = client.chat.completions.create(**request).choices
    texts, finishes, calls, _, _ = collect(client.chat.completions.create(**request, stream=True))
    assert any(c.message.tool_calls for c in whole)
    for index, choice in enumerate(whole):
        assert finishes[index] == choice.finish_reason
        if choice.message.tool_calls:
            assert [(c.type, c.function.name, c.function.arguments) for c in calls[index]] == [
                (c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            assert all(c.id.startswith("call_") and c.index == k for k, c in enumerate(calls[index]))
            assert texts[index] == ""
        else:
            assert index not in calls and texts[index] == choice.message.content


def test_held_back_keeps_what_may_become_a_stop_string():
    from rlorch.serve.openai_routes import held_back

    assert held_back("abc=", ["=x"]) == "abc"
    assert held_back("abc=x1", ["=x12"]) == "abc"
    assert held_back("abc", ["=x"]) == "abc"
    assert held_back("ab\ufffd", []) == "ab"


def test_a_client_that_leaves_a_stream_aborts_its_sequences(plain_server):
    import http.client
    import time

    def stats() -> dict:
        with urllib.request.urlopen(f"http://{plain_server}/get_server_info", timeout=10) as response:
            return json.loads(response.read())["internal_states"][0]

    before = stats()["generated_tokens"]
    host, port = plain_server.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "1", "max_tokens": 100, "stream": True,
                                                                  "ignore_eos": True}),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    assert response.read(7) == b"data: {"
    connection.sock.close()
    connection.close()
    deadline = time.monotonic() + 10
    while stats()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats()["num_running_reqs"] == 0
    assert stats()["generated_tokens"] - before < 100, "the abandoned sequence was aborted, not run to its end"


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"model": "tiny"}, "messages"),
    ("/chat/completions", {"messages": USER, "n": 0}, "n"),
    ("/chat/completions", {"messages": USER, "temperature": -1}, "temperature"),
    ("/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"messages": USER, "tools": [CALCULATE], "tool_choice": {
        "type": "function", "function": {"name": "search"}}}, "tool_choice"),
    ("/chat/completions", {"messages": USER, "tools": [CALCULATE], "tool_choice": "required"}, "tool_choice"),
    ("/chat/completions", {"messages": USER, "tools": [CALCULATE], "tool_choice": {
        "type": "function", "function": {"name": "calculate"}}}, "tool_choice"),
    ("/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/chat/completions", {"messages": USER, "presence_penalty": 1.0}, "presence_penalty"),
    ("/completions", {"prompt": []}, "prompt"),
    ("/completions", {"prompt": [5, 100000]}, "prompt"),
    ("/completions", {"prompt": "1", "logprobs": 99}, "logprobs"),
    ("/completions", {"prompt": "1", "top_k": 0}, "top_k"),
])
def test_bad_requests_answer_400_naming_the_parameter(client, path, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.post(path, body=body, cast_to=object)
    assert err.value.status_code == 400
    assert err.value.param == param
    assert set(err.value.body) == {"message", "type", "param", "code"}
    assert err.value.body["type"] == "invalid_request_error"


def test_a_malformed_body_answers_400_and_the_server_keeps_serving(client, server):
    status, body = post(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["message"].startswith("invalid JSON body")
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(server, "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    assert client.completions.create(model="tiny", prompt="1", max_tokens=1).usage.completion_tokens == 1


def test_an_unknown_tool_call_parser_is_refused(model_dir):
    from rlorch.serve.server import serve_model

    with pytest.raises(ValueError, match="tool_call_parser"):
        CpuServer(model_dir, tool_call_parser="llama9")
    assert serve_model(str(model_dir), host="127.0.0.1", port=0, dtype="float32", implementation="auto", threads=1,
                       max_batch=4, seed=0, transfer_timeout=1.0, weight_version="0", parent=None, api_key=None,
                       min_step_time=0.0, tool_call_parser="llama9") == 2
    with pytest.raises(ValueError, match="tool-call parser"):
        parse_tool_calls("llama9", "x", [CALCULATE])
    from rlorch.serve.arguments import launch_args_problem

    assert launch_args_problem(["--tool-call-parser", "pipe"]) is None, "a run's engines take it in launch_args"
    assert "invalid choice" in launch_args_problem(["--tool-call-parser", "llama9"])


# ---- rlorch.openai_api ----------------------------------------------------------------------

def test_pipe_parser():
    (call,) = parse_tool_calls("pipe", "37+45|junk", [CALCULATE])[1]
    assert parse_tool_calls("pipe", "37+45|junk", [CALCULATE])[0] is None
    assert call["type"] == "function" and call["function"] == {"name": "calculate",
                                                                "arguments": json.dumps({"expression": "37+45"})}
    assert parse_tool_calls("pipe", "calculate:1+2|", [CALCULATE])[1][0]["function"]["arguments"] == \
        '{"expression": "1+2"}'
    both = [CALCULATE, LOOKUP]
    content, calls = parse_tool_calls("pipe", "lookup:abc|", both)
    assert content is None and calls[0]["function"] == {"name": "lookup", "arguments": '{"key": "abc"}'}
    assert parse_tool_calls("pipe", "abc|", both) == ("abc|", []), "two tools need a name"
    assert parse_tool_calls("pipe", "search:abc|", both) == ("search:abc|", []), "an unknown tool is no call"
    assert parse_tool_calls("pipe", "37+45", [CALCULATE]) == ("37+45", [])
    assert parse_tool_calls("pipe", "37+45|", []) == ("37+45|", [])


def test_qwen25_parser():
    block = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+2"}}\n</tool_call>'
    content, calls = parse_tool_calls("qwen25", "Let me compute.\n" + block, [CALCULATE])
    assert content == "Let me compute."
    assert calls[0]["function"] == {"name": "calculate", "arguments": '{"expression": "1+2"}'}
    two = block + "\n" + block.replace("1+2", "3*4")
    assert [json.loads(c["function"]["arguments"]) for c in parse_tool_calls("hermes", two, [CALCULATE])[1]] == [
        {"expression": "1+2"}, {"expression": "3*4"}]
    assert parse_tool_calls("qwen25", block, [CALCULATE])[0] is None
    stringly = block.replace('{"expression": "1+2"}', json.dumps('{"expression": "1+2"}'))
    assert parse_tool_calls("qwen25", stringly, [CALCULATE])[1][0]["function"]["arguments"] == '{"expression": "1+2"}'
    for bad in ("<tool_call>\n{not json}\n</tool_call>", block.replace("calculate", "search"),
                "<tool_call>\n{\"name\": \"calculate\", \"arguments\": {}", "plain text"):
        assert parse_tool_calls("qwen25", bad, [CALCULATE]) == (bad, []), bad
    calls = [c["id"] for c in parse_tool_calls("qwen25", two, [CALCULATE])[1]]
    assert len(set(calls)) == 2


def test_parse_chat_request_normalises_and_names_what_is_wrong():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                              "max_tokens": 9, "stop": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert req.messages[0]["content"] == "a" and req.max_tokens == 9 and req.stop == ["x"]
    assert req.stream and req.include_usage and req.n == 1 and req.temperature is None
    nameless = [{"type": "function", "function": {}}]
    for body, param in [({"messages": USER, "max_tokens": 0}, "max_tokens"), ({"messages": USER, "seed": "1"}, "seed"),
                        ({"messages": USER, "top_p": 0}, "top_p"), ({"messages": USER, "stop": ["a"] * 5}, "stop"),
                        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
                        ({"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
                        ({"messages": [*USER, {"role": "user"}]}, "messages[1].content"),
                        ({"messages": USER, "tools": nameless}, "tools[0].function.name")]:
        with pytest.raises(ApiError) as err:
            parse_chat_request(body)
        assert err.value.param == param and err.value.body()["error"]["param"] == param
    with pytest.raises(ApiError):
        parse_chat_request([1])
    shouted = parse_chat_request({"messages": [{"role": "System", "content": "be brief"}, *USER,
                                               {"role": "assistant", "content": None}]})
    assert [m["role"] for m in shouted.messages] == ["system", "user", "assistant"]   # as SGLang normalises
    completion = parse_completion_request({"prompt": [[1, 2], [3]], "logprobs": 0, "echo": True})
    assert completion.prompts == [[1, 2], [3]] and completion.logprobs == 0 and completion.echo


def test_chunks_reassemble_a_tool_call_body():
    content, calls = parse_tool_calls("pipe", "2*3|", [CALCULATE])
    body = chat_completion_body(model="m", choices=[ChatChoice(index=0, text="2*3|", finish_reason="length",
                                                               tool_calls=calls, content=content)],
                                prompt_tokens=4, completion_tokens=5, id="chatcmpl-x", created=1)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    chunks = chat_completion_chunks(body, include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [calls[0]["function"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 9
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    stream = sse(chunks)
    assert stream.endswith(b"data: [DONE]\n\n") and stream.count(b"data: ") == len(chunks) + 1
