"""The simdjson reading of /generate answers gives bit for bit what parsing them as JSON gives, on
every shape SGLang sends, and refuses (or hands to the full parse) what it cannot vouch for."""

from __future__ import annotations

import asyncio
import json
import random
from array import array
from decimal import Decimal, getcontext

import numpy
import pytest

from rlorch.inference.answers import Segment, parse_generate, segment
from rlorch.inference.scan import Brackets, Irregular, read_entries
from rlorch.types import LOGPROBS, TOKEN_IDS


def reference(body: bytes):
    """What SGLang's answer says, read by Python's own JSON parser entry by entry."""
    tree = json.loads(body)
    return [None if (a.get("meta_info") or {}).get("output_token_logprobs") is None
            else segment(a["meta_info"]["output_token_logprobs"]) for a in (tree if isinstance(tree, list) else [tree])]


def parsed(body: bytes):
    tree = parse_generate(body)
    return [None if (a.get("meta_info") or {}).get("output_token_logprobs") is None
            else segment(a["meta_info"]["output_token_logprobs"]) for a in (tree if isinstance(tree, list) else [tree])]


def outcome(read, body: bytes):
    """The arrays' bytes, or the kind of error."""
    try:
        return [None if s is None else (s[0].tobytes(), s[1].tobytes()) for s in read(body)]
    except (ValueError, OverflowError) as err:
        return type(err).__name__


def answer(entries: str, *, text: str = '"7"') -> str:
    return ('{"text":' + text + ',"output_ids":[1,2],"meta_info":{"id":"a","finish_reason":{"type":"stop"},'
            '"output_token_logprobs":' + entries + ',"weight_version":"3"}}')


def entries(logprobs, ids=None, third: str = "null") -> str:
    ids = ids or [i % 151936 for i in range(len(logprobs))]
    return "[" + ",".join(f"[{lp},{i},{third}]" for lp, i in zip(logprobs, ids)) + "]"


def float32_logprobs(count: int, seed: int) -> list[float]:
    rng = numpy.random.default_rng(seed)
    return (-rng.exponential(2, count)).astype(numpy.float32).astype(numpy.float64).tolist()


def midpoint_decimals(count: int, seed: int) -> list[str]:
    """Decimals at, just under and just over the midpoints between neighbouring float32s, with
    17 to 25 significant digits: where a float64 estimate could round to the wrong float32."""
    getcontext().prec = 60
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        low = numpy.float32(-rng.uniform(1e-6, 30.0))
        high = numpy.nextafter(low, numpy.float32(0))
        middle = (Decimal(float(low)) + Decimal(float(high))) / 2
        digits = rng.randint(17, 25)
        for nudge in (-1, 0, 1):
            text = format(middle.quantize(Decimal(1).scaleb(middle.adjusted() - digits + 1)), "f")
            last = Decimal(1).scaleb(middle.adjusted() - digits + 1) * nudge
            out.append(format(Decimal(text) + last, "f" if nudge else "e"))
    return out


TRICKY = ["-1.5e-05", "-1e-07", "-1E+2", "-2.5E-3", "-0.0", "0.0", "0", "-0", "-1", "-12", "-3.0517578125e-05",
          "-1e-300", "-1e300", "-4.9e-324", "-1.17549435e-38", "-1.1754942e-38", "-3.4028235e+38", "-3.4028236e38",
          "-0.000012345", "-0.12345678901234567890123", "-1234567890123456789", "-9007199254740993",
          "-1.00000000000000011102230246251565404236316680908203125", "-1e0", "-1e-0005", "-7.006492321624085e-46",
          "-1.401298464324817e-45", "-16777217", "-0.1", "-0.30000000000000004", "-99.99999999999999"]


def test_float32_logprobs_read_bit_for_bit_as_json_gives_them():
    logprobs = float32_logprobs(5000, seed=1)
    body = entries([repr(x) for x in logprobs]).encode()
    ids, values = read_entries(body, [(0, len(body))])[0]
    assert ids.tobytes() == array(TOKEN_IDS, range(5000)).tobytes()
    assert values.tobytes() == array(LOGPROBS, logprobs).tobytes()


@pytest.mark.parametrize("seed", [0, 1])
def test_midpoints_exponents_and_long_mantissas_match_pythons_parser(seed):
    texts = midpoint_decimals(400, seed) + TRICKY
    texts += [t[1:] for t in texts if t.startswith("-")]
    random.Random(seed).shuffle(texts)
    body = entries(texts).encode()
    ids, values = read_entries(body, [(0, len(body))])[0]
    assert values.tobytes() == array(LOGPROBS, [float(json.loads(t)) for t in texts]).tobytes()
    assert ids.tolist() == list(range(len(texts)))


def test_token_ids_from_zero_to_int32s_largest():
    ids = [0, 1, 9, 10, 151935, 99999999, 100000000, 2147483647] * 40
    body = entries(["-0.5"] * len(ids), ids).encode()
    assert read_entries(body, [(0, len(body))])[0][0].tolist() == ids


def test_what_json_reads_as_a_number_is_read_so():
    """Whitespace inside an entry and an id written as a float are JSON: read as JSON reads them
    (and as :func:`segment` takes an id, by its integer value)."""
    for written, logprob, token in [("[[-1 ,5,null]]", -1.0, 5), ("[[ -1,\t5,null]]", -1.0, 5),
                                    ("[[-0.5,5.0,null]]", -0.5, 5), ("[[-2,7e1,null]]", -2.0, 70)]:
        body = written.encode()
        ids, values = read_entries(body, [(0, len(body))])[0]
        assert (ids.tolist(), values.tolist()) == ([token], [logprob]), written


@pytest.mark.parametrize("bad", [
    "[[-0.5, 5, null]]", "[[-0.5,5,null] ]", '[[-0.5,5,"a"]]', "[[-0.5,5]]", "[[-0.5,5,null,null]]",
    "[[-0.5,5,nul]]", "[[-0.5,5,llun]]", "[[-0.5,05,null]]", "[[-0.5,-5,null]]", "[[-0.5,5.5,null]]",
    "[[-0.5,2147483648,null]]", "[[-0.5,5,6,null]]", "[[-0.5,null],[1,2,3,null]]", "[[9e99,5,null]]",
    "[[-0.5,true,null]]", "[[-123456789012345678901234,5,null]]", "[[-0.5,5,null],[-0.5,5,null,null]]",
    "[[1]]", "[[null]]", "[[,null]]", "[[5,null]]", "[[-0.5,,null]]", "[[,5,null]]", "[[-05,5,null]]", "[[-.5,5,null]]",
    "[[-5.,5,null]]", "[[+5,5,null]]", "[[--5,5,null]]", "[[-5e,5,null]]", "[[-5e+,5,null]]", "[[-5-,5,null]]",
    "[[-5.5.5,5,null]]", "[[-5e5e5,5,null]]", "[[-inf,5,null]]", "[[NaN,5,null]]", "[[null,5,null]]",
    "[[-0.5,5,null][-0.5,5,null]]", "[[-0.5,5,null],[-0.5,5,null],]", "[[-0.5,5,null]]5", "[[-0.5,5,null]5]",
    "[[-0.5,5,null],[-0.5,null,5]]", "[[-0.5,5,null],-0.5,[5,null]]", "[[-0.5,5,null]],[[-0.5,5,null]]",
    "[[-0.5,5,null],[[-0.5,5,null]]]", "[[-0x1,5,null]]", "[[-1_0,5,null]]", "[[-1e400,5,null]]",
])
def test_anything_off_the_compact_shape_is_refused(bad):
    body = bad.encode()
    with pytest.raises(Irregular):
        read_entries(body, [(0, len(body))])[0]


def corpus() -> list[bytes]:
    """Bodies past SMALL_BODY in every shape an SGLang server sends (and some it does not)."""
    many = float32_logprobs(700, seed=2)
    plain = entries([repr(x) for x in many])
    bodies = [answer(plain), "[" + answer(plain) + "," + answer(entries(TRICKY * 20)) + "]",
              answer(entries(midpoint_decimals(300, seed=3))),
              answer(plain, text='"he said \\"]]\\", [1,2,null], \\u00e9\\n' + "x" * 20000 + '"'),
              answer("null", text='"' + "y" * 20000 + '"'),
              "[" + answer(plain) + "," + answer("[]") + "," + answer(plain) + "]"]
    texts = ['"a"', '"\\"]]"', '","', '"[1,2,null]"', '"null"', '"\\u00e9"', '"]],[["']
    bodies.append(answer("[" + ",".join(f"[{lp!r},{i},{texts[i % len(texts)]}]" for i, lp in enumerate(many)) + "]"))
    bodies.append(answer("[" + ", ".join(f"[{lp!r}, {i}, null]" for i, lp in enumerate(many)) + "]"))
    bodies.append(answer(entries([repr(x) for x in many[:-1]] + ["NaN"])))
    bodies.append(answer(entries([repr(x) for x in many[:-1]] + ["-Infinity"])))
    bodies.append(answer(entries([repr(x) for x in many[:-1]] + ["null"])))
    bodies.append(answer(entries([repr(x) for x in many[:-1]] + ["-1e400"])))
    bodies.append(answer(entries(["-0.5"] * 1400, [5] * 1399 + [2147483648])))
    bodies.append(answer(entries(["-0.5"] * 1400, [5] * 1399 + ["5.0"])))
    bodies.append(answer(entries(["-0.5"] * 1400, [5] * 1399 + ["-5"])))
    bodies.append(answer(entries(["-0.5"] * 1399 + ["-123456789012345678901234"])))
    return [b.encode() for b in bodies]


def test_every_body_of_the_corpus_reads_as_pythons_parser_reads_it():
    for body in corpus():
        assert len(body) > 16384
        assert outcome(parsed, body) == outcome(reference, body), body[:200]


def test_the_fast_path_takes_what_sglang_sends():
    body = corpus()[1]
    tree = parse_generate(body)
    assert all(isinstance(a["meta_info"]["output_token_logprobs"], Segment) for a in tree)


def test_a_refused_span_leaves_the_parser_reusable_and_threads_read_apart():
    """Each thread's simdjson parser is kept across calls: a refusal (an error raised by the
    parser) must not leave a document holding it, and threads must not share one."""
    good = entries([repr(x) for x in float32_logprobs(3000, seed=4)]).encode()
    expected = [a.tobytes() for a in read_entries(good, [(0, len(good))])[0]]
    for bad in (b"[[-0.5,true,null]]", b"[[NaN,5,null]]", b"[[-0.5,5,null],[-0.5,5,null,null]]"):
        with pytest.raises(Irregular):
            read_entries(bad, [(0, len(bad))])
        assert [a.tobytes() for a in read_entries(good, [(0, len(good))])[0]] == expected
    import threading
    seen = []

    def read():
        for _ in range(20):
            seen.append([a.tobytes() for a in read_entries(good, [(0, len(good))])[0]] == expected)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [True] * 80


def test_brackets_find_where_each_array_ends():
    body = b'{"output_ids":[4,5],"text":"a]]b","e":[[-1,4,null],[-2,5,null]],"f":[],"g":[[1,2,null]'
    brackets = Brackets(body)
    assert body[:brackets.list_end(body.index(b"[4") + 1)].endswith(b"[4,5]")
    opened = body.index(b"[[-1") + 1
    assert body[opened - 1:brackets.entries_end(opened)] == b"[[-1,4,null],[-2,5,null]]"
    assert brackets.entries_end(body.index(b"[]") + 1) == body.index(b"[]") + 2
    assert brackets.entries_end(body.index(b"[[1,2") + 1) == -1  # unterminated
    assert brackets.list_end(len(body)) == -1


def handing_off_everything(workers: int = 1):
    from rlorch.inference.answers import AnswerParsers

    parsers = AnswerParsers(workers)
    parsers.HANDED_OFF = 0  # the corpus's bodies are far under a megabyte
    return parsers


def test_parse_workers_read_every_body_of_the_corpus_as_the_loop_does():
    parsers = handing_off_everything()

    async def parse_all():
        return [await parsers.parse(body) for body in corpus()]

    try:
        trees = asyncio.run(parse_all())
    finally:
        parsers.close()
    assert not parsers.broken and parsers.handed == len(trees)
    for body, tree in zip(corpus(), trees):
        assert outcome(lambda _: parsed_tree(tree), body) == outcome(parsed, body), body[:200]


def parsed_tree(tree):
    return [None if (a.get("meta_info") or {}).get("output_token_logprobs") is None
            else segment(a["meta_info"]["output_token_logprobs"]) for a in (tree if isinstance(tree, list) else [tree])]


def test_a_dead_parse_worker_leaves_the_loop_parsing_and_loses_no_answer(caplog):
    import multiprocessing
    import os
    import signal

    parsers = handing_off_everything()
    body = corpus()[1]

    async def scenario():
        first = await parsers.parse(body)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
        return first, await parsers.parse(body), await parsers.parse(body)

    try:
        with caplog.at_level("WARNING", logger="rlorch.inference.answers"):
            trees = asyncio.run(scenario())
    finally:
        parsers.close()
    assert parsers.broken and parsers.handed == 2  # the third went straight to the loop
    assert [outcome(lambda _: parsed_tree(tree), body) for tree in trees] == [outcome(parsed, body)] * 3
    assert sum("answer-parsing worker died" in r.message for r in caplog.records) == 1


def test_bodies_past_what_the_workers_hold_are_parsed_in_the_loop():
    parsers = handing_off_everything(workers=1)
    bodies = corpus()[:6]

    async def all_at_once():
        return await asyncio.gather(*(parsers.parse(body) for body in bodies))

    try:
        trees = asyncio.run(all_at_once())
    finally:
        parsers.close()
    assert parsers.handed == parsers.QUEUED == 2 and parsers.out == 0
    for body, tree in zip(bodies, trees):
        assert outcome(lambda _: parsed_tree(tree), body) == outcome(parsed, body)


ORCHESTRATOR = """
import asyncio, multiprocessing, sys, time
sys.path.insert(0, {tests!r})
from test_scan import corpus, handing_off_everything
parsers = handing_off_everything(workers=2)
asyncio.run(parsers.parse(corpus()[0]))
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
time.sleep(600)
"""


def test_parse_workers_exit_when_the_orchestrator_is_killed():
    """A killed orchestrator closes nothing: each worker, holding its own end of the queue it
    waits on, would wait for ever. They watch for it instead."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from rlorch.lifecycle import process_running

    orchestrator = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR.format(tests=str(Path(__file__).parent))],
                                    stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in orchestrator.stdout.readline().split()]
        assert workers and all(process_running(pid) for pid in workers)
    finally:
        os.kill(orchestrator.pid, signal.SIGKILL)
        orchestrator.wait()
    deadline = time.monotonic() + 15
    while any(process_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_running(pid) for pid in workers)
