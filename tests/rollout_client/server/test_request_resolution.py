"""Request checks in process: packed prompt bytes."""

import numpy as np
import pytest

from rollout_client import RolloutRequest
from rollout_client.server.generator import GeneratorInfo
from rollout_client.server.request_resolution import resolve_request

INFO = GeneratorInfo(vocab_size=100, eos_token_ids=(1,), model_config_hash="h", dtype="float32", max_seq_len=64,
                     max_batch_size=4)


def test_prompt_round_trips_as_little_endian_int32():
    (spec,) = resolve_request(RolloutRequest([5, 99, 0]).to_proto(), INFO)
    assert spec.prompt_token_ids.tolist() == [5, 99, 0] and spec.prompt_token_ids.dtype == np.int32


def test_prompt_bytes_not_a_multiple_of_four_name_the_field():
    request = RolloutRequest([5, 6]).to_proto()
    request.prompt_token_ids = request.prompt_token_ids[:-1]
    with pytest.raises(ValueError, match=r"^prompt_token_ids: 7 bytes"):
        resolve_request(request, INFO)

