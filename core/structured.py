"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, grammar)
compiled by llguidance into a matcher that says, token by token, what may come next.

Why llguidance: one abi3 wheel with no dependencies and no compile step; a matcher costs about a
millisecond; the batched mask fill runs on its own threads without the interpreter lock; and on a
byte-level BPE with a length-bounded string it produced no invalid output where xgrammar 0.2.8
let raw control bytes through (see docs/benchmarks.md). A schema keyword it cannot enforce is an
error, never silently ignored.

The engine owns one `Grammars`: requests' constraints compile on a worker thread (the step never
waits for a compile; the scheduler holds such a request back, "deferred"), compiled grammars are
cached by constraint, and each request gets its own copy of the matcher, which advances with
every token the request accepts. No torch here: gpu/ turns the bitmask into masked logits.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


# Free whitespace between JSON tokens, by default: at most one line break, then at most 32
# spaces or tabs. Compact JSON and ordinary pretty-printed JSON (indent 2 or 4, eight levels
# deep at 4) both fit; a model cannot spend its token budget on blank lines or runs of spaces.
WHITESPACE = r"(?:\r?\n)?[ \t]{0,32}"


class Constraint(msgspec.Struct, frozen=True, gc=False):
    """What a request's output must match. `spec`: a JSON schema (text) for json, a regex, a
    JSON list of strings for choice, a Lark or GBNF grammar; empty for json_object."""

    kind: str
    spec: str = ""
    any_whitespace: bool = True  # JSON may hold whitespace between tokens (vLLM's default)
    # The whitespace allowed between JSON tokens when any_whitespace: a regex; None: WHITESPACE.
    whitespace_pattern: str | None = None
    # False (the default, as vLLM's xgrammar): an object schema that lists properties and
    # leaves additionalProperties unsaid allows no other keys. True: JSON Schema's own default.
    additional_properties: bool = False
    # A thinking model reasons first, unconstrained: "open" when the prompt opened the think
    # block (the output is reasoning up to </think>), "optional" when the output may open one.
    think: str = ""
    # The think block's markers as Lark: quoted text, or a special token written `<[id]>` (a
    # model whose markers are special tokens: Magistral's, Command R7B's)
    think_marks: tuple[str, str] = ('"<think>"', '"</think>"')
    # tool_choice auto with strict tools and a response format: `spec` (kind grammar) is the
    # Lark grammar of a reply that is either calls or `@answer`, the text this constraint
    # (response_format's) allows. Without a response format the text is free and unset here.
    answer: Constraint | None = None


# Where a JSON schema holds further schemas: keyword -> how (one schema, a list, a name map).
_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "contains",
        "propertyNames", "not", "if", "then", "else")  # fmt: skip
_MANY = ("prefixItems", "anyOf", "oneOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, closable: bool = True) -> Any:
    """`schema` with additionalProperties: false on every object schema that lists properties
    and leaves the keyword unsaid (one that lists none, {"type": "object"}, still means any
    object). Members of an allOf stay open: each lists only part of the object's keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, closable=False) for s in out["allOf"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if (
        closable
        and "allOf" not in out
        and isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def json_options(c: Constraint) -> dict[str, Any]:
    """llguidance's JSON options for a constraint: the whitespace between tokens."""
    if not c.any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": c.whitespace_pattern or WHITESPACE}


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar for a constraint. Raises ValueError for input that is not even
    well-formed (a schema that is not JSON); the grammar's own errors come from `check`."""
    inner = _with_answer(c) if c.answer is not None else _inner_grammar(c)
    return _after_think(inner, c.think, c.think_marks) if c.think else inner


def _grammars(text: str) -> dict[str, Any]:
    """llguidance's top-level grammar object for compiled grammar text (JSON) or plain Lark."""
    try:
        return json.loads(text)
    except ValueError:
        return {"grammars": [{"lark_grammar": text}]}


def _with_answer(c: Constraint) -> str:
    """The reply's grammar (`c.spec`, Lark that says `@answer`) over the answer's own."""
    if c.kind != "grammar" or c.answer is None or c.answer.answer is not None:
        raise ValueError("an answer nests under a grammar constraint, one level deep")
    nested = _grammars(_inner_grammar(c.answer))["grammars"]
    nested[0]["name"] = "answer"
    reply = {"name": "reply", "lark_grammar": c.spec}
    return json.dumps({"grammars": [reply, *nested]})


def _after_think(inner: str, think: str, marks: tuple[str, str]) -> str:
    """The constraint's grammar behind a free think block (to the first end marker, then any
    whitespace), as vLLM applies constraints once the reasoning has ended. A text end marker
    stops a lazy body; one that holds a special token follows a greedy one (no text lexeme
    takes a special token, and llguidance takes none as a stop)."""
    top = _grammars(inner)
    answer = top["grammars"][0]
    answer["name"] = name = answer.get("name") or "answer"
    start, end = marks
    if end.startswith('"') and "<[" not in end:
        rules = f"body[stop={end}]: /(?s:.*)/\n"
    else:
        rules = f"body: text {end}\ntext: /(?s:.*)/\n"
    rules += "ws: /[ \\t\\r\\n]*/"
    if think == "open":
        lark = f"start: body ws @{name}\n{rules}"
    elif think == "optional":
        lark = f"start: think? @{name}\nthink: {start} body ws\n{rules}"
    else:
        raise ValueError(f"think must be open or optional, not {think!r}")
    return json.dumps({"grammars": [{"name": "main", "lark_grammar": lark}, *top["grammars"]]})


def _inner_grammar(c: Constraint) -> str:
    import llguidance as llg

    if c.kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if c.kind == "json_object" else json.loads(c.spec)
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object")
        if schema is False:
            raise ValueError("the JSON schema false allows no value")
        if schema is True:  # JSON Schema's own spelling of {}: any value (llguidance takes {})
            schema = {}
        if c.kind == "json" and not c.additional_properties:
            schema = close_objects(schema)
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=json_options(c))
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        choices = json.loads(c.spec)
        if not choices or not all(isinstance(x, str) for x in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(x) for x in choices)
        )
    if c.kind == "grammar":
        return llg.grammar_from("grammar", c.spec)  # Lark, or GBNF converted to Lark
    raise ValueError(f"unknown constraint kind {c.kind!r}; one of {', '.join(KINDS)}")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies use."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _plain_added_tokens(data: dict[str, Any]) -> None:
    """Added tokens that are not special (Qwen3's <think> and </think>, tool markup) are plain
    text to the model and in its output, but llguidance would treat every added token as a
    special one (bytes it never matches against a grammar's text), while still tokenizing
    forced text into them: a grammar that forces "<think>" then refuses the very token it
    forced. In a byte-level BPE they become ordinary vocabulary entries instead."""
    model = data.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        return
    alphabet = byte_level_alphabet()
    kept = []
    for tok in data.get("added_tokens") or []:
        if tok.get("special", True):
            kept.append(tok)
            continue
        piece = "".join(alphabet[b] for b in tok["content"].encode("utf-8"))
        model["vocab"].setdefault(piece, tok["id"])
    data["added_tokens"] = kept


def llg_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the model's fast tokenizer. `vocab_size` is the lm_head width, so
    ids past the tokenizer's own vocabulary (padding rows) are masked too."""
    import llguidance as llg

    data = json.loads(tokenizer_json)
    data["padding"] = data["truncation"] = None
    _plain_added_tokens(data)
    return llg.LLTokenizer(json.dumps(data), n_vocab=vocab_size, eos_token=list(eos_token_ids))


class Grammars:
    """Compiles constraints for one tokenizer: `check` (errors, for the server's 400), `start`
    (a request's matcher, compiled off the engine step), `fill` (the batch's bitmask)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words in one row of the bitmask
        self._args = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()  # pristine matchers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weir-grammar")
        self._executor = None
        self.done = threading.Event()  # set when a compile finishes (the engine may wait on it)

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(*self._args)
            return self._tokenizer

    @property
    def executor(self):
        """llguidance's thread pool for the batch's masks and tokens (engine thread only)."""
        if self._executor is None:
            import llguidance as llg

            self._executor = llg.LLExecutor()
        return self._executor

    def check(self, c: Constraint) -> str | None:
        """None if the constraint compiles and matches some text, else why not."""
        import llguidance as llg

        try:
            grammar = grammar_text(c)
            # What follows a think block is checked alone: the block itself matches any text.
            answer = grammar_text(msgspec.structs.replace(c, think="")) if c.think else grammar
        except (ValueError, TypeError) as e:
            return str(e)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            return error
        if c.any_whitespace and c.whitespace_pattern is not None:
            error = self._check_whitespace(c.whitespace_pattern)
            if error:
                return error
        # A grammar can compile and still match no text at all (a regex such as [^\s\S]): its
        # matcher fails on its first mask, which in the engine would end the request with an
        # error once sampling reached it. Found here, it is the client's 400.
        matcher = llg.LLMatcher(self.tokenizer, answer, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            reason = matcher.get_error().split("\n", 1)[0].strip()
            return f"it matches no text ({reason})" if reason else "it matches no text"
        return None

    def _check_whitespace(self, pattern: str) -> str | None:
        """A request's whitespace pattern may match JSON's whitespace only (space, tab, line
        feed, carriage return): text of its that is anything else (an \\s* also matches form
        feeds and Unicode spaces) would make the output invalid JSON."""
        import llguidance as llg

        # The pattern's strings that are not JSON whitespace, as a grammar: none, or a 400.
        other = "start: OTHER\nOTHER: /(?:%s)/ & ~/[ \\t\\n\\r]*/" % pattern.replace("/", "\\/")
        matcher = llg.LLMatcher(self.tokenizer, llg.grammar_from("lark", other), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            return None
        return (
            f"whitespace_pattern {pattern!r} matches more than JSON whitespace (space, tab, "
            "line feed, carriage return), which would make the output invalid JSON"
        )

    def _compile(self, c: Constraint):
        import llguidance as llg

        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
        if hit is None:
            hit = llg.LLMatcher(self.tokenizer, grammar_text(c), log_level=0)
            if hit.is_error():
                raise ValueError(hit.get_error())
            with self._lock:
                self._cache[c] = hit
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return hit.deep_copy()

    def start(self, c: Constraint) -> Future:
        """A future of a fresh matcher for `c`, compiled (or copied from the cache) on the
        worker thread; `done` is set when it completes."""
        future = self._pool.submit(self._compile, c)
        future.add_done_callback(lambda _: self.done.set())
        return future

    def fill(self, rows: list[tuple[Any, int]], pointer: int, num_rows: int) -> None:
        """Write each (matcher, row) pair's allowed-token bitmask into row `row` of the int32
        array at `pointer` ([num_rows, words]); bit t of a row set: token t is allowed."""
        self.executor.unsafe_compute_mask_ptr(rows, pointer, self.words * 4, num_rows)

    def consume(self, pairs: list[tuple[Any, int]]) -> None:
        """Advance each (matcher, token) pair; a matcher that refuses its token is left in its
        error state, which the engine reads per request."""
        self.executor.consume_token_par(pairs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
