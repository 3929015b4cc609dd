"""Issue #49, item 3: a bad reply costs its samples, never the run (the hostile server of tests/faults, a real
process on 127.0.0.1; the request id names the fault, which hits sample 0).

- A stream that ends without sample 0's final message, or sends it as an unknown ``sample_index``: sample 0 is
  dropped and counted (``samples/dropped/missing_final``, ``unknown_sample_index``); samples 1 and 2 are kept.
- A message over gRPC's size limit ends the call with RESOURCE_EXHAUSTED: the samples it had not delivered are
  dropped and counted (``message_too_large``), the ones it had are kept.
- Any other error status is one `EngineCallError` line from the pool, naming the engine's address and the status
  (`learner.rl.error_lines` prints it as one ``error:`` line).
"""

import pytest

from learner.rl.error_lines import USER_ERRORS
from rollout_client import EngineCallError, EnginePool, Member, TetherEngine
from tests.faults.test_rollout_faults import client, dropped, request, server  # noqa: F401 -- module fixtures


@pytest.mark.parametrize("fault, problem", [("missing_final", "missing_final"),
                                            ("unknown_index", "unknown_sample_index")])
def test_a_missing_or_unknown_final_message_drops_its_sample_only(client, fault, problem):  # noqa: F811
    honest = client.generate(request("honest"))
    before = dropped(client)
    samples = client.generate(request(fault))
    after = dropped(client)
    assert {name: after[name] - before[name] for name in after if after[name] != before[name]} == {
        f"samples/dropped/{problem}": 1}
    assert [sample.sample_index for sample in samples] == [1, 2]
    assert [s.completion_token_ids.tolist() for s in samples] == [s.completion_token_ids.tolist() for s in honest[1:]]


def test_an_over_size_message_drops_the_samples_its_call_had_not_delivered(client):  # noqa: F811
    before = dropped(client)
    samples = client.generate(request("oversize"))
    after = dropped(client)
    lost = after["samples/dropped/message_too_large"] - before["samples/dropped/message_too_large"]
    assert 1 <= lost == 3 - len(samples)  # sample 0 at least; the others unless they came before it
    assert 0 not in [sample.sample_index for sample in samples]
    assert {name: after[name] - before[name] for name in after if after[name] != before[name]} == {
        "samples/dropped/message_too_large": lost}
    assert client.generate(request("honest"))  # the connection serves on


def test_any_other_error_status_is_one_line_naming_the_engine_and_the_status(server):  # noqa: F811
    from rollout_client import ClientConfig

    pool = EnginePool([Member(server.target, TetherEngine(ClientConfig(target=server.target)))])
    try:
        with pytest.raises(EngineCallError) as raised:
            pool.submit(request("internal")).result(timeout=120)
    finally:
        pool.close()
    assert str(raised.value) == (f"a request to the engine at {server.target} failed: AioRpcError: INTERNAL: "
                                 "tests.support.hostile_server: internal")
    assert EngineCallError in USER_ERRORS  # the command line prints it as one error: line
