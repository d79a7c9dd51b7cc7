"""Structured output: compiling a request's constraint (scheduler/grammar_spec.py) with xgrammar off the
scheduler thread,
and the per-request matcher that fills the next-token bitmask and accepts sampled tokens.

Bitmask layout (xgrammar's): int32 [batch, ceil(vocab/32)], token t allowed iff bit t % 32 of word t // 32
is set. Masks cover the model vocab (config vocab_size), which may be larger than the tokenizer's: the
ids past the tokenizer are never allowed.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tandem.scheduler.grammar_spec import GrammarBusy, GrammarError, GrammarSpec, choice_ebnf
from tandem.scheduler.schema_rewrite import rewrite_schema_text
from tandem.scheduler.tokenizer_info_cache import load_or_build
from tandem.scheduler.utf8_guard import ACCEPT, REJECT, Utf8Guard

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["GrammarBusy", "GrammarCompilerService", "GrammarError", "GrammarSpec", "RequestGrammar",
           "allocate_bitmask", "build_tokenizer_info", "choice_ebnf"]


# Bounds on what grammars may hold (docs/limits.md): the compiled ones cached, by count and by their own
# size (a regex with wide repetitions compiles to MBs), and the distinct ones waiting to compile.
CACHE_SIZE = 256
CACHE_BYTES = 256 * 2**20
MAX_PENDING = 64


# xgrammar's C++ errors start with "[12:34:56] /project/cpp/file.cc:94: " and may carry a CHECK prefix.
_NOISE = re.compile(r"^\[[\d:.]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


def _clean_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _NOISE.sub("", msg).strip()


def _special_token_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None
) -> xgr.TokenizerInfo:
    """xgrammar's TokenizerInfo over the model vocab, with special tokens never allowed as text.

    from_huggingface treats added special tokens ("<|im_start|>", even the EOS) as ordinary strings, so a
    free JSON string or `.*` could emit them mid-output. Blanking their vocab entries makes xgrammar mask
    them; stop tokens stay allowed where the grammar may end (that is decided by stop_token_ids)."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None
    )
    encoded: list[str] = [""] * vocab_size  # "" = never allowed (also the ids past the tokenizer)
    for tok, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            encoded[i] = tok
    for i in _special_token_ids(tokenizer):
        if i < vocab_size:
            encoded[i] = ""
    return xgr.TokenizerInfo(
        encoded,
        base.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(base.stop_token_ids),
        add_prefix_space=base.add_prefix_space,
    )


def _model_eos_ids(model_dir: str) -> list[int] | None:
    from tandem.protocol.model_info import read_model_info

    try:
        return read_model_info(model_dir).eos_token_ids or None
    except (OSError, ValueError, KeyError):  # not a model dir (e.g. a bare tokenizer dir): xgrammar decides
        return None


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """int32 [batch, ceil(vocab_size/32)] on the CPU, all tokens allowed."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarCompilerService:
    """Compiles GrammarSpecs in background threads, each distinct spec once (LRU of `cache_size` grammars and
    `cache_bytes`; at most `max_pending` distinct ones waiting or compiling, past it GrammarBusy).

    xgrammar's compiler releases the GIL while compiling and is safe to call from several threads, so
    `max_workers` > 1 compiles different grammars in parallel. stop_token_ids: the tokens that end a
    complete output, allowed only where the grammar may end; None = the engine's EOS set for the model
    (ModelInfo.eos_token_ids: config + generation_config), else the tokenizer's eos_token_id.
    """

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        max_workers: int = 1,
        *,
        stop_token_ids: Sequence[int] | None = None,
        tokenizer: Any = None,
        any_whitespace: bool = True,
        compiler_threads: int = 2,
        cache_size: int = CACHE_SIZE,
        cache_bytes: int = CACHE_BYTES,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else _model_eos_ids(model_dir)
        self.any_whitespace = any_whitespace
        self.compiler_threads = compiler_threads
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.max_pending = max_pending
        self.num_compiled = 0  # compilations actually run (cache misses)
        # the TokenizerInfo was read from disk (scheduler/tokenizer_info_cache.py)
        self.info_from_cache = False
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._guard: Utf8Guard | None = None
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        # Compiled, sized and counted, but their futures not yet resolved: the room is made before a
        # waiter can see the grammar, so the cache is within its bytes whenever a grammar is visible.
        self._finishing: dict[tuple[str, str], int] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")

    # -- compiler ---------------------------------------------------------------------------------

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """Loaded on first use (tokenizer + vocab scan take a while for big vocabs)."""
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                if self._tokenizer is None:  # the model's own: its TokenizerInfo may be on disk already
                    self._info, self.info_from_cache = load_or_build(
                        self.model_dir, self.vocab_size, self.stop_token_ids, self._build_info)
                else:
                    self._info = self._build_info()
                self._guard = Utf8Guard(self._info.decoded_vocab, self.vocab_size)
                # Our own cache replaces xgrammar's, which is unbounded by default.
                self._compiler = xgr.GrammarCompiler(
                    self._info, max_threads=self.compiler_threads, cache_enabled=False
                )
            return self._compiler

    def _build_info(self) -> xgr.TokenizerInfo:
        if self._tokenizer is None:
            from tandem.protocol.tokenizer_loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir)
        return build_tokenizer_info(self._tokenizer, self.vocab_size, self.stop_token_ids)

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        self.compiler  # noqa: B018 - loads it
        assert self._info is not None
        return self._info

    def _compile_and_make_room(self, spec: GrammarSpec, box: list[Future[Any]]) -> xgr.CompiledGrammar:
        compiled = self._compile(spec)
        with self._lock:  # submit() has put this compilation's future in box before releasing the lock
            if self._cache.get(spec.key) is box[0]:
                self._finishing[spec.key] = int(compiled.memory_size_bytes)
                self._evict_locked(keep=spec.key)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self.compiler  # outside the try: a tokenizer that fails to load is not a client error
        with self._lock:
            self.num_compiled += 1
        try:
            if spec.kind == "json_schema":
                text = rewrite_schema_text(spec.text)
                return compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.text)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(spec.choices()))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError from C++ (also ValueError/TypeError)
            raise GrammarError(f"invalid {spec.kind}: {_clean_error(e)}") from e
        raise GrammarError(f"unknown constraint kind {spec.kind!r}")

    # -- public -----------------------------------------------------------------------------------

    def submit(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar, shared by every request with the same spec. A bad constraint fails the
        future with GrammarError."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            pending = sum(not f.done() for f in self._cache.values())
            if pending >= self.max_pending:
                raise GrammarBusy(f"{pending} distinct grammars are compiling already; retry later")
            box: list[Future[xgr.CompiledGrammar]] = []  # the future, for its own compilation to find
            fut = self._pool.submit(self._compile_and_make_room, spec, box)
            box.append(fut)
            self._cache[spec.key] = fut
            self._evict_locked()
        fut.add_done_callback(lambda f, key=spec.key: self._on_done(key, f))
        return fut

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Blocking submit()."""
        return self.submit(spec).result(timeout)

    def matcher(self, compiled: xgr.CompiledGrammar) -> RequestGrammar:
        self.compiler  # noqa: B018 - loads the guard with it
        return RequestGrammar(compiled, self.vocab_size, self._guard)

    def allocate_bitmask(self, batch: int) -> torch.Tensor:
        return allocate_bitmask(batch, self.vocab_size)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def _sized_locked(self) -> list[tuple[tuple[str, str], int]]:
        """The entries whose size is known, oldest first: compiled (finishing or finished)."""
        return [(k, self._finishing[k] if k in self._finishing else _grammar_bytes(f))
                for k, f in self._cache.items() if k in self._finishing or f.done()]

    def _evict_locked(self, keep: tuple[str, str] | None = None) -> None:
        # Only compiled entries go, oldest first (a pending future may be waited on by requests not yet
        # matched); `keep`: the one being made room for.
        sized = self._sized_locked()
        held = sum(n for _, n in sized)
        for key, n in sized:
            if len(self._cache) <= self.cache_size and held <= self.cache_bytes:
                break
            if key == keep:
                continue
            held -= n
            del self._cache[key]
            self._finishing.pop(key, None)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._sized_locked())

    def _on_done(self, key: tuple[str, str], fut: Future[Any]) -> None:
        with self._lock:
            if self._cache.get(key) is fut:
                self._finishing.pop(key, None)
            # A bad constraint fails the same way every time (keep it); anything else may be transient.
            if fut.cancelled() or (
                fut.exception() is not None and not isinstance(fut.exception(), GrammarError)
            ):
                if self._cache.get(key) is fut:
                    del self._cache[key]
            self._evict_locked()  # its size is known now


def _grammar_bytes(fut: Future[Any]) -> int:
    if fut.cancelled() or fut.exception() is not None:
        return 0
    return int(fut.result().memory_size_bytes)


class RequestGrammar:
    """One constrained request's matcher state. Not thread-safe: drive it from the scheduler thread."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int | None = None, utf8: Utf8Guard | None = None
    ) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._utf8 = utf8
        self._utf8_states = [ACCEPT]  # the output bytes' UTF-8 state after each accepted token
        # The compiled grammar's TokenizerInfo spans the model vocab (GrammarCompilerService.vocab_size).
        self.vocab_size = vocab_size if vocab_size is not None else compiled.tokenizer_info.vocab_size
        self.stop_token_ids: list[int] = list(self._matcher.stop_token_ids)
        self.num_accepted = 0  # tokens accepted since reset (the stop token included)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False: the grammar cannot accept it (the state is unchanged
        and the request must end with an error)."""
        # Checked here so xgrammar does not log a C++ warning for these.
        if not 0 <= token_id < self.vocab_size or self._matcher.is_terminated():
            return False
        state = self._utf8.next_state(self._utf8_states[-1], token_id) if self._utf8 else ACCEPT
        if state == REJECT or not self._matcher.accept_token(int(token_id)):
            return False
        self._utf8_states.append(state)
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete and the request should finish."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token would be accepted now)."""
        return self._matcher.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row] (CPU int32). Returns False when the row allows
        every token (masking can be skipped)."""
        if self._matcher.is_terminated():
            # xgrammar raises here; the request is ending anyway, so allow only its stop tokens.
            bitmask[row].zero_()
            for t in self.stop_token_ids:
                if t < self.vocab_size:
                    bitmask[row, t // 32] |= _bit(t % 32)
            return True
        needed = self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._utf8 is None:
            return needed
        valid = bitmask[row] & self._utf8.masks[self._utf8_states[-1]]
        if not valid.any():
            return needed  # the grammar demands invalid bytes: it alone decides
        bitmask[row] = valid
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (n <= num_accepted)."""
        if not 0 <= n <= self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: only {self.num_accepted} accepted")
        if n:
            self._matcher.rollback(n)
            self.num_accepted -= n
            del self._utf8_states[-n:]

    def reset(self) -> None:
        self._matcher.reset()
        self.num_accepted = 0
        self._utf8_states = [ACCEPT]

    def replay(self, tokens: Iterable[int]) -> bool:
        """Reset, then accept `tokens` (e.g. a retracted request's kept output). False: one was rejected
        (the state is then that of the accepted prefix)."""
        self.reset()
        return all(self.accept(t) for t in tokens)


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int that fits int32 (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i
