"""`rlorch serve` over real HTTP: SGLang-shaped answers, batching, errors, flow control.

Shapes follow SGLang 0.5.x's native API (checked against sgl-project/sglang sources of the 0.5
line, around 0.5.3: srt/entrypoints/http_server.py for the routes and pause/continue answers,
srt/managers/tokenizer_manager.py for meta_info): meta_info carries id, finish_reason
({"type": "stop", "matched"} | {"type": "length", "length"} | {"type": "abort", "message"}),
prompt_tokens, completion_tokens, cached_tokens, weight_version, e2e_latency and, with
return_logprob, output_token_logprobs as [logprob, token_id, text]; a batch or n > 1 answers a
prompt-major JSON array; errors answer 400 with {"error": {"message"}}.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from rlorch.serve.server import CpuServer, ServerThread, rlorch_version

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(model_dir):
    thread = ServerThread(CpuServer(model_dir, min_step_time=0.005, threads=1))
    yield thread.address
    thread.stop()


def call(address: str, path: str, payload=None, *, raw: bytes | None = None, method: str | None = None):
    data = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
    request = urllib.request.Request(f"http://{address}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body.decode()


def generate(address: str, **payload):
    status, body = call(address, "/generate", payload)
    assert status == 200, body
    return body


def stats(address: str) -> dict:
    return call(address, "/get_server_info")[1]["internal_states"][0]


def test_single_request_answers_sglang_shape(server):
    out = generate(server, input_ids=PROMPT, rid="one", return_logprob=True,
                   sampling_params={"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                    "ignore_eos": True})
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "one"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "0" and meta["e2e_latency"] > 0
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(entry[0] <= 0 and entry[2] is None for entry in meta["output_token_logprobs"])
    plain = generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert "output_token_logprobs" not in plain["meta_info"]


def test_batch_and_n_answer_prompt_major_arrays(server):
    out = generate(server, input_ids=[PROMPT, [9, 10]], rid="b",
                   sampling_params={"max_new_tokens": 3, "n": 2, "ignore_eos": True})
    assert [o["meta_info"]["id"] for o in out] == ["b_0_0", "b_0_1", "b_1_0", "b_1_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [4, 4, 2, 2]
    assert all(len(o["output_ids"]) == 3 for o in out)
    many = generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "n": 3})
    assert isinstance(many, list) and len(many) == 3
    per_prompt = generate(server, input_ids=[PROMPT, PROMPT], rid=["x", "y"],
                          sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2, "ignore_eos": True}])
    assert [o["meta_info"]["id"] for o in per_prompt] == ["x", "y"]
    assert len(per_prompt[1]["output_ids"]) == 2


def test_text_input_and_greedy_determinism(server):
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = generate(server, text="123+45=", sampling_params=params, return_logprob=True)
    second = generate(server, text="123+45=", sampling_params=params, return_logprob=True)
    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["prompt_tokens"] == 8  # <bos> and the seven characters
    assert isinstance(first["text"], str)
    stop_at = first["output_ids"][2]
    stopped = generate(server, text="123+45=", sampling_params={**params, "stop_token_ids": [stop_at]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert stopped["output_ids"] == first["output_ids"][:first["output_ids"].index(stop_at) + 1]
    text = first["text"]
    if len(text) >= 3:
        by_string = generate(server, text="123+45=", sampling_params={**params, "stop": text[2]})
        assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": text[2]}
        assert by_string["text"] == text[:text.index(text[2])]


def test_a_text_prompt_is_encoded_as_training_encodes_it(server, model_dir):
    from transformers import AutoTokenizer

    from rlorch.tasks.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = encode_prompt(tokenizer, "407=")
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 5
    params = {"max_new_tokens": 4, "temperature": 0}
    by_text = generate(server, text="407=", sampling_params=params)
    by_ids = generate(server, input_ids=ids, sampling_params=params)
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["output_ids"] == by_ids["output_ids"]


def test_serve_reads_a_run_directory_as_its_newest_weights(tmp_path):
    from rlorch.config.schema import ConfigError
    from rlorch.serve.server import served_weights

    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    with pytest.raises(ConfigError, match="no published weights"):
        served_weights(str(run))
    for step in (1, 2, 10):
        (run / "weights" / f"step_{step:06d}").mkdir()
        (run / "weights" / f"step_{step:06d}" / "PUBLISHED").touch()
    (run / "weights" / "step_000011").mkdir()  # being written: not published yet
    assert served_weights(str(run)) == (str(run / "weights" / "step_000010"), 10), "its version is its step"
    assert served_weights(str(tmp_path)) == (str(tmp_path), None) and served_weights(None) == (None, None)


@pytest.mark.parametrize("payload, fragment", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[]]}, "empty"),
    ({"input_ids": ["a", "b"]}, "integers"),
    ({"input_ids": [1, 2], "text": "12"}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": [1, 2], "sampling_params": [{}, {}]}, "sampling_params"),
    ({"input_ids": [1, 10**9]}, "token ids"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [[1, 2], [3, 4]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2.0}]},
     "max_new_tokens"),
    ({"input_ids": [[1, 2], [3, 4]], "sampling_params": [{"ignore_eos": True}, {"ignore_eos": 1}]}, "ignore_eos"),
    ({"input_ids": [[1, 2], [1, True]]}, "integers"),
    ({"input_ids": [[1, 2], [1, -1]]}, "token ids"),
    # An integer past 64 bits stays an integer, and NaN a number: each is refused for what it is.
    ({"input_ids": [1, 2**64 + 1]}, "token ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": float("nan")}}, "temperature"),
])
def test_bad_generate_requests_get_400_and_server_keeps_serving(server, payload, fragment):
    status, body = call(server, "/generate", payload)
    assert status == 400
    assert fragment in body["error"]["message"]
    assert generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})["output_ids"]


def test_a_request_id_orjson_cannot_write_is_answered_escaped(server):
    """A rid with a lone surrogate is a JSON string Python reads; its answer goes out escaped."""
    out = generate(server, input_ids=PROMPT, rid="a\ud800", sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["id"] == "a\ud800" and len(out["output_ids"]) == 1


def test_batch_texts_are_what_the_tokenizer_decodes(model_dir):
    """Answers' texts, decoded together per skip_special_tokens setting, equal each sequence's
    own decode; a text a stop string cut is kept."""
    from rlorch.serve.batcher import Sequence
    from rlorch.serve.sampling import RequestParams

    engine = CpuServer(model_dir, threads=1)
    assert engine._decode_batch is not None, "the default tokenizer takes the batch path"
    special = engine.tokenizer.all_special_ids
    outputs = [[5, 6, special[0], 7], [special[-1], 8], [], [9, 10, 11], [special[0]]]
    seqs = []
    for index, ids in enumerate(outputs):
        params = RequestParams.parse({"skip_special_tokens": index % 2 == 0}, engine.vocab_size)
        seqs.append(Sequence(rid=str(index), prompt=PROMPT, params=params, done=None, output_ids=ids))
    seqs[3].text = "cut"
    expected = [engine.tokenizer.decode(ids, skip_special_tokens=index % 2 == 0) for index, ids in enumerate(outputs)]
    expected[3] = "cut"
    assert engine.texts(seqs) == expected
    assert engine.tokenizer.decode(outputs[1], skip_special_tokens=True) != expected[1], "the setting matters"


def test_invalid_json_and_bad_checkpoint_get_400(server, tmp_path):
    status, body = call(server, "/generate", raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = call(server, "/generate", raw=b"[1, 2]")
    assert status == 400 and body["error"]["message"]
    status, body = call(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and body["success"] is False and "missing" in body["message"]
    (tmp_path / "empty").mkdir()
    status, body = call(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "empty")})
    assert status == 400 and body["success"] is False and "safetensors" in body["message"]
    assert call(server, "/get_weight_version")[1] == {"weight_version": "0"}
    assert generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})["output_ids"]


def test_reloading_the_same_checkpoint_sets_the_version(server, model_dir):
    status, body = call(server, "/update_weights_from_disk",
                        {"model_path": str(model_dir), "weight_version": "0", "abort_all_requests": False})
    assert status == 200 and body["success"] is True and body["num_paused_requests"] == 0


def test_info_endpoints(server, model_dir):
    status, info = call(server, "/get_server_info")
    assert status == 200 and info["status"] == "ready" and info["version"] == rlorch_version()
    status, model = call(server, "/get_model_info")
    assert model["is_generation"] is True and model["weight_version"] == "0"
    assert call(server, "/v1/models")[1]["data"][0]["object"] == "model"
    assert call(server, "/health")[0] == 200 and call(server, "/health_generate")[0] == 200
    assert call(server, "/flush_cache")[0] == 200
    status, body = call(server, "/update_weight_version", {"new_version": "7", "abort_all_requests": False})
    assert body["success"] and call(server, "/get_weight_version")[1] == {"weight_version": "7"}
    call(server, "/update_weight_version", {"new_version": "0"})


async def _post_all(address: str, payloads: list[dict]) -> list:
    async with aiohttp.ClientSession() as session:
        async def one(payload):
            async with session.post(f"http://{address}/generate", json=payload) as response:
                return await response.json()
        return await asyncio.gather(*(one(p) for p in payloads))


async def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_requests_held_by_pause_are_decoded_as_one_batch(server):
    before = stats(server)

    async def scenario():
        assert call(server, "/pause_generation", {})[1]["status"] == "ok"
        payloads = [{"input_ids": PROMPT + [i], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
                    for i in range(6)]
        pending = asyncio.ensure_future(_post_all(server, payloads))
        await _wait_for(lambda: stats(server)["num_held_reqs"] == 6)
        assert call(server, "/continue_generation", {})[1]["status"] == "ok"
        return await pending

    answers = asyncio.run(scenario())
    after = stats(server)
    assert all(a["meta_info"]["finish_reason"]["type"] == "length" for a in answers)
    assert after["batches"] == before["batches"] + 1
    assert after["max_batch_seen"] >= 6


def test_pause_returns_partial_output_as_abort(server):
    async def scenario():
        payload = {"input_ids": PROMPT, "rid": "long", "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        start = stats(server)["generated_tokens"]
        pending = asyncio.ensure_future(_post_all(server, [payload]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 3)
        call(server, "/pause_generation", {"mode": "abort"})
        (answer,) = await pending
        held = asyncio.ensure_future(_post_all(server, [{**payload, "rid": "later"}]))
        await _wait_for(lambda: stats(server)["num_held_reqs"] == 1)
        call(server, "/continue_generation", {})
        return answer, (await held)[0]

    aborted, later = asyncio.run(scenario())
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"]
    assert 3 <= meta["completion_tokens"] < 100
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert later["meta_info"]["finish_reason"] == {"type": "length", "length": 100}


def test_abort_request_by_rid(server):
    async def scenario():
        payload = {"input_ids": PROMPT, "rid": "victim",
                   "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        start = stats(server)["generated_tokens"]
        pending = asyncio.ensure_future(_post_all(server, [payload]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 2)
        assert call(server, "/abort_request", {"rid": "victim"})[0] == 200
        return (await pending)[0]

    answer = asyncio.run(scenario())
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["meta_info"]["completion_tokens"] < 100


def test_sampler_reports_what_sglang_reports_whatever_the_cut():
    import torch

    from rlorch.serve.sampling import RequestParams, sample

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    params = [RequestParams(temperature=2.0), RequestParams(temperature=1.0, top_k=1),
              RequestParams(temperature=0.0)]
    tokens, logprobs, tops = sample(logits.clone(), params, [[], [], []], torch.Generator().manual_seed(0))
    assert tops is None
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits[0] / 2, -1)[tokens[0]].item())
    assert tokens[1] == 1 and logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[1].item())
    assert tokens[2] == 0 and logprobs[2] == pytest.approx(torch.log_softmax(logits[2], -1)[0].item())
    nucleus = [RequestParams(top_p=0.5)]
    tokens, logprobs, _ = sample(logits[1:2].clone(), nucleus, [[1]], torch.Generator().manual_seed(0))
    banned = logits[1].clone()
    banned[1] = float("-inf")
    assert tokens == [3] and logprobs[0] == pytest.approx(torch.log_softmax(banned, -1)[3].item())
    assert logprobs[0] < -0.1
    _, chosen, tops = sample(logits.clone(), params, [[], [], []], torch.Generator().manual_seed(0), top=[2, 0, 1])
    assert [token for token, _ in tops[0]] == [0, 1] and tops[1] == []
    assert tops[0][0][1] == pytest.approx(torch.log_softmax(logits[0] / 2, -1)[0].item())
    assert tops[2] == [(0, pytest.approx(chosen[2]))], "greedy: the top token is the one taken, same logprob"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_sampler_refuses_logits_that_are_not_finite_naming_them(bad):
    """Even in a greedy row: on a GPU a NaN reaching multinomial is a device-side assert that
    takes the engine's CUDA context with it, and a greedy argmax of NaN is a token of nothing."""
    import torch

    from rlorch.serve.sampling import RequestParams, sample

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, bad, 1.0, 2.0]])
    with pytest.raises(FloatingPointError, match="logits are not finite"):
        sample(logits, [RequestParams(), RequestParams(temperature=0.0)], [[], []], torch.Generator().manual_seed(0))


def test_top_k_one_matches_greedy_over_http(server):
    greedy = generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True})
    top1 = generate(server, input_ids=PROMPT, return_logprob=True,
                    sampling_params={"max_new_tokens": 5, "top_k": 1, "ignore_eos": True})
    assert top1["output_ids"] == greedy["output_ids"]
    logprobs = [entry[0] for entry in top1["meta_info"]["output_token_logprobs"]]
    assert all(value < 0 for value in logprobs), "SGLang reports the uncut log_softmax(logits / T), never 0"


def test_pause_in_place_keeps_requests_until_continue_or_abort(server):
    async def scenario():
        payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
        start = stats(server)["generated_tokens"]
        kept = asyncio.ensure_future(_post_all(server, [{**payload, "rid": "kept"}]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 2)
        call(server, "/pause_generation", {"mode": "in_place"})
        at_pause = stats(server)["generated_tokens"]
        await asyncio.sleep(0.2)    # a window in which nothing may be generated (not a wait for a state)
        # The decode step under way when the pause came may still finish: one token at most.
        assert stats(server)["generated_tokens"] <= at_pause + 1 and stats(server)["num_running_reqs"] == 1
        call(server, "/continue_generation", {})
        (kept_answer,) = await kept
        start = stats(server)["generated_tokens"]
        dropped = asyncio.ensure_future(_post_all(server, [{**payload, "rid": "dropped"}]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 2)
        call(server, "/pause_generation", {"mode": "in_place"})
        call(server, "/pause_generation", {"mode": "abort"})
        call(server, "/continue_generation", {})
        return kept_answer, (await dropped)[0]

    kept, dropped = asyncio.run(scenario())
    assert kept["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert dropped["meta_info"]["finish_reason"]["type"] == "abort"


def test_an_unpaused_weight_update_waits_for_the_running_batch_only(server, model_dir):
    """Without a pause, an update waits for the batch decoding when it came: requests that
    arrive meanwhile neither join that batch nor start before the load, so they are decoded by
    the new weights, and a stream of them cannot hold it off."""
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    short = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}

    async def scenario():
        start = stats(server)["generated_tokens"]
        running = asyncio.ensure_future(_post_all(server, [long]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 2)
        update = asyncio.ensure_future(asyncio.to_thread(
            call, server, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "9"}))
        await _wait_for(lambda: stats(server)["num_updates_waiting"] == 1)
        arrivals = [asyncio.ensure_future(_post_all(server, [short])) for _ in range(3)]
        status, body = await update
        return (await running)[0], [(await a)[0] for a in arrivals], status, body

    try:
        before, after, status, body = asyncio.run(scenario())
    finally:
        call(server, "/update_weight_version", {"new_version": "0"})
    assert status == 200 and body["success"] is True
    assert before["meta_info"]["weight_version"] == "0" and before["meta_info"]["finish_reason"]["type"] == "length"
    assert [a["meta_info"]["weight_version"] for a in after] == ["9"] * 3


def test_arrivals_join_a_running_batch_without_changing_greedy_outputs(server):
    greedy = {"temperature": 0, "ignore_eos": True}
    long_prompt, wide, narrow = PROMPT, list(range(4, 16)), [20, 21]
    alone = [generate(server, input_ids=prompt, sampling_params={**greedy, "max_new_tokens": n})["output_ids"]
             for prompt, n in ((long_prompt, 60), (wide, 8), (narrow, 8))]
    before = stats(server)

    async def scenario():
        start = stats(server)["generated_tokens"]
        running = asyncio.ensure_future(_post_all(server, [
            {"input_ids": long_prompt, "sampling_params": {**greedy, "max_new_tokens": 60}}]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 3)
        first = asyncio.ensure_future(_post_all(server, [
            {"input_ids": wide, "sampling_params": {**greedy, "max_new_tokens": 8}}]))
        await _wait_for(lambda: stats(server)["generated_tokens"] >= start + 30)
        second = asyncio.ensure_future(_post_all(server, [
            {"input_ids": narrow, "sampling_params": {**greedy, "max_new_tokens": 8}}]))
        return [(await task)[0]["output_ids"] for task in (running, first, second)]

    together = asyncio.run(scenario())
    after = stats(server)
    assert after["batches"] - before["batches"] == 1 and after["joined"] - before["joined"] == 2
    assert together == alone


def test_a_prompt_shared_by_a_group_is_prefilled_once_and_decodes_as_it_does_alone(server):
    """GRPO sends each prompt G times: the batch prefills each distinct prompt once and copies its
    KV cache rows, and every copy decodes as that prompt does on its own (greedy tokens, logprobs)."""
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
    prompts = [PROMPT, [9, 10, 11]]
    alone = [generate(server, input_ids=prompt, sampling_params=greedy, return_logprob=True) for prompt in prompts]
    before = stats(server)
    grouped = generate(server, input_ids=prompts, sampling_params={**greedy, "n": 4}, return_logprob=True)
    after = stats(server)
    assert after["sequences"] - before["sequences"] == 8
    assert after["prefill_rows"] - before["prefill_rows"] == 2
    assert len(grouped) == 8
    for index, answer in enumerate(grouped):
        own = alone[index // 4]
        assert answer["output_ids"] == own["output_ids"]
        assert [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [lp for lp, _, _ in own["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_health_generate_waits_behind_a_pause_and_fails_when_it_outlasts_the_probe(server, monkeypatch):
    from rlorch.serve import server as server_module

    monkeypatch.setattr(server_module, "HEALTH_CHECK_TIMEOUT", 0.3)
    call(server, "/pause_generation", {"mode": "abort"})
    try:
        assert call(server, "/health_generate")[0] == 503
    finally:
        call(server, "/continue_generation", {})
    assert call(server, "/health_generate")[0] == 200


def test_memory_occupation_follows_sglangs_rules_and_refuses_where_sglang_would_die(model_dir):
    """Released tags (none: all three) come back only when resumed; a release while a request
    runs, a resume of a tag never released, generation, continue or a load into released weights
    are refused with 400 (SGLang's scheduler would die), and the server serves on afterwards."""
    thread = ServerThread(CpuServer(model_dir, min_step_time=0.02, threads=1))
    address = thread.address
    try:
        async def busy_release():
            async with aiohttp.ClientSession() as session:
                running = asyncio.ensure_future(session.post(f"http://{address}/generate", json={
                    "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}))
                while not stats(address)["num_running_reqs"]:
                    await asyncio.sleep(0.01)
                refused = await asyncio.to_thread(call, address, "/release_memory_occupation", {"tags": ["kv_cache"]})
                await (await running).read()
                return refused

        refused = asyncio.run(busy_release())
        assert refused[0] == 400 and "idle" in refused[1]["error"]["message"]
        assert call(address, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400
        assert call(address, "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
        assert call(address, "/release_memory_occupation", {}) == (200, None)
        assert call(address, "/get_server_info")[1]["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
        for path, payload in (("/generate", {"input_ids": PROMPT}), ("/continue_generation", {}),
                              ("/update_weights_from_disk", {"model_path": str(model_dir)})):
            status, body = call(address, path, payload)
            assert status == 400 and "resume_memory_occupation" in json.dumps(body), (path, body)
        assert call(address, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
        assert call(address, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "3"})[0] == 200
        assert call(address, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
        assert generate(address, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})["meta_info"]["weight_version"] == "3"
    finally:
        thread.stop()
