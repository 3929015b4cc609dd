"""The model generator: the learner's own transformer with a jitted prefill and KV-cache decode.

Sequences occupy fixed slots of one batched KV cache (`max_batch_size` rows of
`max_seq_len` slots), so concurrent requests decode together. A new sequence is
prefilled alone into its row; every `step` then runs `decode_steps_per_call` decode
steps in one jitted `lax.scan` (fewer Python round trips; pauses take effect at that
granularity) over the active rows only: live sequences are kept in the lowest rows
(a finished one's row is refilled by moving the highest live row down), and a step
decodes the first power-of-two rows that hold them (`decode_rows`; idle rows among
them write nothing), sliced from the cache and written back in place, so a step
costs what its live sequences need whatever `max_batch_size` is, with at most
log2(max_batch_size) + 1 decode programs. (A gather/scatter of scattered rows
instead costs a pass over the whole cache on XLA:CPU.) The
token at position x of sample i is drawn with key
``fold_in(fold_in(key(seed), i), x)``, so it does not depend on which other
sequences share the batch. Its logits may: a decode of 32 rows can round differently from one of 8 (measured on
XLA:CPU, ~1e-6 in the logprobs), so ``batch_invariant`` decodes every row at every step (one decode program):
then a sample's tokens and logprobs are the same whatever shares the batch (reproducible runs,
``loop.deterministic``), at the cost of computing idle rows. Weights are received in ``weights_dtype`` (the learner's
parameter dtype, or the serving dtype when the learner casts them on its device before publishing) and copied to the
device in the serving dtype. A sequence kept across a weight update (partial rollouts) keeps its cached keys and
values, or has them rebuilt under the new weights by `recompute_cache`: one batched prefill of every active row's
tokens (each row's token history is kept on the host for it), after which its next tokens are drawn exactly as a
fresh request with the same tokens would draw them. Besides safetensors files, UpdateWeights(path) reads the
learner's orbax checkpoints (`read_orbax`).
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from learner.model.param_paths import parameter_names
from learner.model.precision import with_matmul_precision
from learner.model.transformer import Transformer, cast_model
from learner.reporting.compiles import compile_stats, count_compiles
from learner.serving.orbax_weights import read_orbax
from learner.serving.sampling import sample_rows, sample_token
from rollout_client.protocol import pb
from rollout_client.sampling_params import LogprobMode
from rollout_client.server.generator import Generator, GeneratorInfo, SequenceSpec, WeightSpec, check_weights_match
from rollout_client.server.weights_io import WeightReaders


def sample_key(seed: int, sample_index: int) -> np.ndarray:
    """The uint32[2] key of one sample."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), seed >> 32)
    return np.asarray(jax.random.fold_in(key, sample_index))


class ModelGenerator(Generator):
    """Serves a `learner.model.Transformer`.

    Args:
      model: the model in the learner's parameter dtype (defines accepted weights).
      dtype: serving dtype ("float32", "bfloat16", "float16").
      max_batch_size: slots in the KV cache.
      max_seq_len: slots per row; at most the model's max_seq_len.
      decode_steps_per_call: decode steps fused into one jitted call.
      eos_token_ids: default stop tokens; empty: a request without stop tokens runs to
        max_new_tokens.
      matmul_precision: precision of the prefill's and the decode's dots (`learner.model.precision`).
      batch_invariant: decode all ``max_batch_size`` rows at every step, so that no sample's numbers depend on the
        other sequences in the batch (see the module docstring).
      weights_dtype: the dtype of the weights `load_weights` accepts; None: the model's parameter dtype.
    """

    def __init__(self, model: Transformer, dtype: str = "float32", max_batch_size: int = 16,
                 max_seq_len: int | None = None, decode_steps_per_call: int = 8,
                 eos_token_ids: tuple[int, ...] = (), matmul_precision: str = "default",
                 batch_invariant: bool = False, weights_dtype: str | None = None):
        config = model.config
        self._weights_dtype = np.dtype(weights_dtype or config.param_dtype)
        served = model if dtype == config.param_dtype else cast_model(model, dtype)
        self._graphdef, self._params = nnx.split(served)
        self._names, self._treedef = parameter_names(self._params)
        self._expected = {name: (leaf.shape, self._weights_dtype)
                          for name, leaf in zip(self._names, jax.tree.leaves(self._params))}
        self._dtype = dtype
        self._steps = decode_steps_per_call
        self._batch_invariant = batch_invariant
        max_len = min(max_seq_len or config.max_seq_len, config.max_seq_len)
        self._info = GeneratorInfo(
            vocab_size=config.vocab_size,
            eos_token_ids=tuple(eos_token_ids),
            model_config_hash=hashlib.sha256(repr(dataclasses.asdict(config)).encode()).hexdigest()[:16],
            dtype=dtype,
            max_seq_len=max_len,
            max_batch_size=max_batch_size,
        )
        self._cache = served.init_cache(max_batch_size, max_len, dtype)
        self._valid = jnp.zeros((max_batch_size, max_len), bool)
        rows = max_batch_size
        self._tokens = np.zeros(rows, np.int32)  # Last sampled token of each row, not yet in the cache.
        self._positions = np.zeros(rows, np.int32)  # Its position.
        self._history = np.zeros((rows, max_len), np.int32)  # Each row's tokens by position: what the cache holds.
        self._active = np.zeros(rows, bool)
        self._keys = np.zeros((rows, 2), np.uint32)
        self._temperature = np.ones(rows, np.float32)
        self._top_k = np.zeros(rows, np.int32)
        self._top_p = np.ones(rows, np.float32)
        self._min_p = np.zeros(rows, np.float32)
        self._processed = np.zeros(rows, bool)
        self._slots: dict[int, int] = {}
        self._first_tokens: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._prefill = jax.jit(with_matmul_precision(functools.partial(_prefill, self._graphdef), matmul_precision),
                                donate_argnums=(1, 2))
        self._decode = jax.jit(with_matmul_precision(functools.partial(_decode, self._graphdef, self._steps),
                                                     matmul_precision), donate_argnums=(1, 2))
        self._move_row = jax.jit(_move_row, donate_argnums=(0, 1))
        self._refill = jax.jit(with_matmul_precision(functools.partial(_refill, self._graphdef), matmul_precision),
                               donate_argnums=(1, 2))
        self._compiled = {}  # ("prefill", length) / ("decode", rows) / ("move",) -> program (`compile_all`)
        count_compiles()

    def prefill_lengths(self) -> list[int]:
        """The padded prompt lengths a prefill runs at (`prefill_bucket` of every prompt length)."""
        longest = self._info.max_seq_len - 1  # a prompt leaves room for one new token
        firsts = [1, *((1 << k) + 1 for k in range(longest.bit_length()))]  # the shortest prompt of each length
        return sorted({prefill_bucket(length, self._info.max_seq_len) for length in firsts if length <= longest})

    def decode_row_counts(self) -> list[int]:
        """The row counts a decode step runs at (`decode_rows` of every set of active rows; all rows when
        ``batch_invariant``)."""
        if self._batch_invariant:
            return [self._info.max_batch_size]
        return self._row_buckets()

    def _row_buckets(self) -> list[int]:
        """Every `decode_rows` value: the powers of two below ``max_batch_size``, and ``max_batch_size``."""
        rows = self._info.max_batch_size
        return sorted({min(1 << k, rows) for k in range(rows.bit_length() + 1)})

    def compile_all(self, recompute: bool = False) -> int:
        """Compiles every program a request can need (each prefill length, each decode row count, the row move, the
        sample key's), several at a time, so that none compiles while requests wait (the server calls this before it
        serves); returns how many of the engine's own it built. Without it, each compiles on first use.

        ``recompute``: also every `recompute_cache` program (a row count by a length, `refill_shapes`), which partial
        rollouts run at each publish that keeps sequences: else each compiles inside the publish that first needs it.
        """
        firsts = (self._keys[0], self._temperature[0], self._top_k[0], self._top_p[0], self._min_p[0],
                  self._processed[0])
        lowered = {("prefill", length): self._prefill.lower(self._params, self._cache, self._valid, 0,
                                                            np.zeros((1, length), np.int32), 1, *firsts)
                   for length in self.prefill_lengths()}
        lowered |= {("decode", rows): self._decode.lower(self._params, self._cache, self._valid,
                                                         *(array[:rows] for array in self._row_arrays()))
                    for rows in self.decode_row_counts()}
        lowered[("move",)] = self._move_row.lower(self._cache, self._valid, 0, 0)
        if recompute:
            lowered |= {("refill", rows, length): self._refill.lower(
                self._params, self._cache, self._valid, np.zeros((rows, length), np.int32), self._positions[:rows],
                self._active[:rows]) for rows, length in self.refill_shapes()}
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            self._compiled = dict(zip(lowered, pool.map(lambda program: program.compile(), lowered.values())))
        sample_key(0, 0)  # builds the few small programs that derive a sample's key, which every request runs
        return len(self._compiled)

    def program_count(self, recompute: bool = False) -> int:
        """How many programs ``compile_all(recompute)`` builds: each prefill length, each decode row count, the row
        move and, with ``recompute``, each `refill_shapes`."""
        return (len(self.prefill_lengths()) + len(self.decode_row_counts()) + 1
                + (len(self.refill_shapes()) if recompute else 0))

    def refill_shapes(self) -> list[tuple[int, int]]:
        """The (rows, length) a `recompute_cache` runs at: every `decode_rows` count by every prefill length and
        the whole row (a kept sequence can fill its row)."""
        lengths = sorted({*self.prefill_lengths(), self._info.max_seq_len})
        return [(rows, length) for rows in self._row_buckets() for length in lengths]

    @property
    def info(self) -> GeneratorInfo:
        return self._info

    @property
    def compiled_programs(self) -> int:
        """This process's programs built so far (`learner.reporting.compiles`)."""
        return int(compile_stats()["compile/programs"])

    @property
    def weight_spec(self) -> WeightSpec:
        return self._expected

    @property
    def weight_readers(self) -> WeightReaders:
        return {**super().weight_readers, pb.WEIGHTS_FORMAT_ORBAX: read_orbax}

    def add(self, sequence_id: int, spec: SequenceSpec) -> None:
        slot = int(np.flatnonzero(~self._active)[0])
        self._slots[sequence_id] = slot
        sampling = spec.sampling
        self._keys[slot] = sample_key(sampling.seed, spec.sample_index)
        self._temperature[slot] = sampling.temperature
        self._top_k[slot] = sampling.top_k
        self._top_p[slot] = sampling.top_p
        self._min_p[slot] = sampling.min_p
        self._processed[slot] = spec.logprob_mode == LogprobMode.PROCESSED
        prompt_len = spec.prompt_token_ids.size
        bucket = prefill_bucket(prompt_len, self._info.max_seq_len)
        prompt = np.zeros((1, bucket), np.int32)
        prompt[0, :prompt_len] = spec.prompt_token_ids
        prefill = self._compiled.get(("prefill", bucket), self._prefill)
        self._cache, self._valid, token, logprob = prefill(
            self._params, self._cache, self._valid, slot, prompt, prompt_len, self._keys[slot],
            self._temperature[slot], self._top_k[slot], self._top_p[slot], self._min_p[slot], self._processed[slot])
        token, logprob = jax.device_get((token, logprob))  # the add's one wait for the device
        self._tokens[slot], self._positions[slot], self._active[slot] = token, prompt_len, True
        self._history[slot, :prompt_len] = spec.prompt_token_ids
        self._history[slot, min(prompt_len, self._info.max_seq_len - 1)] = token
        self._first_tokens[sequence_id] = (token.reshape(1), logprob.reshape(1))

    def remove(self, sequence_id: int) -> None:
        slot = self._slots.pop(sequence_id)
        self._first_tokens.pop(sequence_id, None)
        self._active[slot] = False
        last = int(np.flatnonzero(self._active)[-1]) if self._active.any() else -1
        if last > slot:  # keep the live rows lowest: the highest one moves into the freed row
            move_row = self._compiled.get(("move",), self._move_row)
            self._cache, self._valid = move_row(self._cache, self._valid, last, slot)
            for array in (*self._row_arrays(), self._history):
                array[slot] = array[last]
            self._active[last] = False
            moved = next(i for i, s in self._slots.items() if s == last)
            self._slots[moved] = slot

    def _row_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-row host arrays, in `_decode`'s argument order."""
        return (self._tokens, self._positions, self._active, self._keys, self._temperature, self._top_k,
                self._top_p, self._min_p, self._processed)

    def step(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        rows = self._info.max_batch_size if self._batch_invariant else decode_rows(self._active)
        decode = self._compiled.get(("decode", rows), self._decode)
        # One upload of the rows' state, one program, one wait for its tokens: per call of `decode_steps_per_call`
        # tokens a row (tests/learner/serving/test_decode_dispatches.py pins these counts).
        row_inputs = jax.device_put(tuple(array[:rows] for array in self._row_arrays()))
        self._cache, self._valid, row_tokens, row_logprobs = decode(self._params, self._cache, self._valid,
                                                                    *row_inputs)
        tokens = np.zeros((self._info.max_batch_size, self._steps), np.int32)
        logprobs = np.zeros((self._info.max_batch_size, self._steps), np.float32)
        tokens[:rows], logprobs[:rows] = jax.device_get((row_tokens, row_logprobs))
        self._record_history(tokens)
        self._tokens[self._active] = tokens[self._active, -1]
        self._positions[self._active] += self._steps
        outputs = {}
        for sequence_id, slot in self._slots.items():
            first_token, first_logprob = self._first_tokens.pop(sequence_id, (tokens[:0, 0], logprobs[:0, 0]))
            outputs[sequence_id] = (np.concatenate([first_token, tokens[slot]]),
                                    np.concatenate([first_logprob, logprobs[slot]]))
        return outputs

    def _record_history(self, tokens: np.ndarray) -> None:
        """Writes a step's tokens (``[max_batch_size, steps]``) after each active row's last position; positions past
        the cache (a generator may overshoot) are dropped."""
        rows = np.flatnonzero(self._active)
        columns = self._positions[rows, None] + 1 + np.arange(self._steps)
        inside = columns < self._info.max_seq_len
        self._history[np.broadcast_to(rows[:, None], columns.shape)[inside], columns[inside]] = tokens[rows][inside]

    def recompute_cache(self) -> None:
        """Rebuilds the active rows' keys and values under the current weights from their token histories: one
        prefill of the first `decode_rows` rows at the `prefill_bucket` of the longest, which writes the active rows
        only."""
        if not self._active.any():
            return
        rows = decode_rows(self._active)
        lengths = np.minimum(self._positions[:rows], self._info.max_seq_len)  # the cache holds [0, position)
        bucket = prefill_bucket(int(lengths[self._active[:rows]].max()), self._info.max_seq_len)
        refill = self._compiled.get(("refill", rows, bucket), self._refill)
        self._cache, self._valid = refill(self._params, self._cache, self._valid, self._history[:rows, :bucket],
                                          lengths, self._active[:rows])

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        check_weights_match(self._expected, weights)
        # A copy whatever the backend (may_alias=False: a CPU device would alias host memory): the arrays may be
        # views of a file that the learner rewrites once this call returns (`weights_io.read_safetensors`).
        leaves = [jax.device_put(weights[name], may_alias=False) for name in self._names]
        if self._weights_dtype != self._dtype:
            leaves = [leaf.astype(self._dtype) for leaf in leaves]
        self._params = jax.tree_util.tree_unflatten(self._treedef, leaves)


def prefill_bucket(length: int, max_len: int) -> int:
    """The padded length a prefill of ``length`` tokens runs at: the power of two (at least 16, at most ``max_len``)
    holding it, so that few prefill programs are compiled.

    >>> prefill_bucket(5, 256), prefill_bucket(17, 256), prefill_bucket(200, 128)
    (16, 32, 128)
    """
    return min(max(16, 1 << (length - 1).bit_length()), max_len)


def decode_rows(active: np.ndarray) -> int:
    """How many leading cache rows a decode step runs: the power of two (at most all rows) holding every active one.

    Example:
        >>> decode_rows(np.array([True, True, False, True, False, False, False, False]))
        4
    """
    used = int(np.flatnonzero(active)[-1]) + 1 if active.any() else 1
    return min(1 << (used - 1).bit_length(), active.size)


def _move_row(cache, valid, source, target):
    """Copies row `source` of the cache and of `valid` into row `target` (in place: both are donated)."""
    return jax.tree.map(lambda c: jax.lax.dynamic_update_slice_in_dim(
        c, jax.lax.dynamic_slice_in_dim(c, source, 1, 0), target, 0), (cache, valid))


def _fresh_rows(model, cache, tokens, lengths):
    """Prefills ``tokens`` ``[R, L]`` (row ``r``'s first ``lengths[r]``) into fresh zero cache rows: the hidden
    states, the rows' cache and their valid slots. Fresh rows, not the previous sequence's: masked slots still enter
    attention as 0 * value, so a NaN left by earlier (e.g. NaN) weights would poison every later sequence in a row."""
    rows, max_len = tokens.shape[0], cache[0].k.shape[1]
    fresh = jax.tree.map(lambda c: jnp.zeros((rows, *c.shape[1:]), c.dtype), cache)
    row_valid = jnp.arange(max_len)[None, :] < jnp.reshape(lengths, (rows, 1))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None, :], tokens.shape)
    hidden, fresh = model.forward_cached(tokens, positions, fresh, row_valid)
    return hidden, fresh, row_valid


def _refill(graphdef, params, full_cache, full_valid, tokens, lengths, active):
    """Recomputes the first ``len(tokens)`` cache rows from their tokens (`_fresh_rows`); inactive rows keep theirs."""
    model = nnx.merge(graphdef, params)
    _, fresh, fresh_valid = _fresh_rows(model, full_cache, tokens, lengths)

    def merged(full, new):
        keep = jnp.reshape(active, (-1,) + (1,) * (new.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(full, jnp.where(keep, new, full[:new.shape[0]]), 0, 0)

    return jax.tree.map(merged, (full_cache, full_valid), (fresh, fresh_valid))


def _prefill(graphdef, params, cache, valid, slot, prompt, prompt_len, key, temperature, top_k, top_p, min_p,
             processed):
    """Writes one prompt into row `slot` of the cache and samples its first completion token."""
    model = nnx.merge(graphdef, params)
    hidden, row, row_valid = _fresh_rows(model, cache, prompt, prompt_len)
    logits = model.logits(hidden[0, prompt_len - 1])
    token, logprob = sample_token(logits, jax.random.fold_in(key, prompt_len), temperature, top_k, top_p, min_p,
                                  processed)
    cache = jax.tree.map(lambda c, r: jax.lax.dynamic_update_slice_in_dim(c, r, slot, 0), cache, row)
    valid = jax.lax.dynamic_update_slice_in_dim(valid, row_valid, slot, 0)
    return cache, valid, token, logprob


def _decode(graphdef, num_steps, params, full_cache, full_valid, tokens, positions, active, keys, temperature, top_k,
            top_p, min_p, processed):
    """`num_steps` decode steps for the first ``len(tokens)`` cache rows (the other arguments are theirs); inactive
    rows write nothing."""
    model = nnx.merge(graphdef, params)
    cache, valid = jax.tree.map(lambda c: c[:tokens.shape[0]], (full_cache, full_valid))
    max_len = valid.shape[1]
    slot_ids = jnp.arange(max_len)[None, :]

    def one_step(carry, _):
        cache, valid, tokens, positions = carry
        write_positions = jnp.where(active, positions, max_len)
        valid = valid | (slot_ids == write_positions[:, None])
        hidden, cache = model.forward_cached(tokens[:, None], write_positions[:, None], cache, valid)
        logits = model.logits(hidden[:, 0])
        step_keys = jax.vmap(jax.random.fold_in)(keys, positions + 1)
        new_tokens, logprobs = sample_rows(logits, step_keys, temperature, top_k, top_p, min_p, processed)
        return (cache, valid, new_tokens, positions + 1), (new_tokens, logprobs)

    (cache, valid, _, _), (new_tokens, logprobs) = jax.lax.scan(
        one_step, (cache, valid, tokens, positions), None, length=num_steps)
    full_cache, full_valid = jax.tree.map(lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, 0, 0),
                                          (full_cache, full_valid), (cache, valid))
    return full_cache, full_valid, new_tokens.T, logprobs.T
