"""The one chat renderer: chat templates rendered in a sandbox, bounded in time and size.

    render_chat(messages, template, add_generation_prompt=False, **variables) -> str

``template`` is a built-in name (``BUILTIN_TEMPLATES``: ``chatml``, ``llama3``) or Jinja template
text (the ``chat_template`` of a tokenizer_config.json). Text without any Jinja tag is refused
(a misspelled built-in name would otherwise render as constant text). Every chat rendering in
ftlib goes through ``render_chat``: ``ftlib.data`` (formatting, ``ftlib.data.render_chat``) and the
tokenizer's ``apply_chat_template``. It lives in this leaf module because ``ftlib.models`` sits
below ``ftlib.data`` and both need it.

Sandbox. Chat templates are untrusted code that came with a checkpoint or dataset, so they run
in jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no
mutation of passed-in objects), configured as Hugging Face ``transformers`` renders them:
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not HTML-escape, the ``raise_exception`` and ``strftime_now`` globals, and the
``{% generation %}...{% endgeneration %}`` tag (used by HF to track assistant spans; here it
renders its body). Rendering the same template text with ftlib and with ``transformers``
therefore gives the same string. (jinja2's ``lipsum`` global, random filler text, is removed.)

Bounds. The sandbox keeps a template away from internals, not from looping for hours or
building a string of gigabytes, so each render is also bounded:

* time: ``max_seconds`` (default ``DEFAULT_MAX_SECONDS`` = 2 s; an ordinary template renders a
  conversation in well under a millisecond), checked at every ``TICK_EVERY``-th (16) of the
  render's loop iterations and calls together (functions, methods, macros, filters): a render
  stops at most 15 cheap steps after its deadline, and reading the clock no longer costs as
  much as the step it guards;
* size: ``max_chars`` (default ``DEFAULT_MAX_CHARS`` = 4,000,000 characters) for the output and
  for every value the template builds, counted deep (a list of strings weighs its length plus
  its strings' lengths): the results of ``+ * ** %``, of ``~`` concatenation, of every call and
  filter, and every ``{% set %}`` value or block. Operations that multiply their input are
  checked *before* they run (``s * n``, ``x ** n``, ``replace``, ``join``, ``expandtabs``,
  ``indent``, widths in ``%`` and ``format`` specs, any integer argument above ``max_chars``),
  so no single step allocates more than a few times ``max_chars``; integers stay under 2**16
  bits. Text a macro or ``{% filter %}`` block writes is checked when the block returns; until
  then it grows at most linearly, for at most ``max_seconds``.

Crossing a bound raises :class:`TemplateLimitError` (a ``ValueError``) saying which bound, the
value and the time spent; a ``MemoryError`` while rendering is turned into the same error with
that reason, never an empty one. Errors the template raises itself (``raise_exception``) and
sandbox refusals (``jinja2.exceptions.SecurityError``) pass through unchanged.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import json
import re
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

__all__ = ["BUILTIN_TEMPLATES", "DEFAULT_MAX_CHARS", "DEFAULT_MAX_SECONDS", "TemplateLimitError", "compile_template",
           "content_passthrough", "render_chat", "template_text"]

BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
DEFAULT_MAX_SECONDS = 2.0
DEFAULT_MAX_CHARS = 4_000_000
TICK_EVERY = 16  # loop items and calls between two reads of the clock (each read costs about as much as an item)
_MAX_INT_BITS = 1 << 16
_NUMBER = re.compile(r"\d+")


class TemplateLimitError(ValueError):
    """A chat template crossed a rendering bound (time, size or memory); the message says which."""


def template_text(template: str) -> str:
    """Built-in name -> its text; Jinja text as is; anything else (a misspelled name) refused."""
    if not isinstance(template, str):
        raise TypeError(f"chat template must be a built-in name or Jinja text, got {type(template).__name__}")
    if template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[template]
    if "{{" not in template and "{%" not in template:
        close = difflib.get_close_matches(template, list(BUILTIN_TEMPLATES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"chat_template {template[:60]!r} is neither a built-in name ({', '.join(BUILTIN_TEMPLATES)})"
                         f"{hint} nor Jinja template text (it has no {{{{ }}}} or {{% %}} tag)")
    return template


# -- bounds ---------------------------------------------------------------------------------------
class _Budget:
    """The bounds of one render: a deadline and a size limit, checked by the hooks below."""

    __slots__ = ("start", "deadline", "max_seconds", "max_chars", "ticks")

    def __init__(self, max_seconds: float, max_chars: int):
        if not max_seconds > 0 or max_chars < 1:
            raise ValueError(f"max_seconds must be > 0 and max_chars >= 1, got {max_seconds!r}, {max_chars!r}")
        self.ticks = 0
        self.start = time.monotonic()
        self.deadline = self.start + max_seconds
        self.max_seconds, self.max_chars = max_seconds, int(max_chars)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def tick(self) -> None:
        """One loop item or call: the clock is read at every ``TICK_EVERY``-th of the render (all loops and calls
        together, so nested short loops are counted too)."""
        self.ticks += 1
        if self.ticks % TICK_EVERY == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template rendering exceeded max_seconds={self.max_seconds:g} (stopped "
                                     f"after {self.elapsed():.2f} s; a loop that does not end?)")

    def refuse(self, what: str, n: int) -> None:
        raise TemplateLimitError(f"chat template {what} would build {n} characters, over max_chars="
                                 f"{self.max_chars} (after {self.elapsed():.2f} s)")

    def weight(self, x, memo: dict | None = None) -> int:
        """Deep size of a value: characters of strings plus items of containers, a shared one counted at each use."""
        if isinstance(x, (str, bytes)):
            return len(x)
        if isinstance(x, int) and not isinstance(x, bool):
            if x.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"chat template built an integer of {x.bit_length()} bits, over "
                                         f"{_MAX_INT_BITS} (after {self.elapsed():.2f} s)")
            return 0
        if not isinstance(x, (list, tuple, dict, set, frozenset)):
            return 0
        memo = {} if memo is None else memo
        if id(x) in memo:
            return memo[id(x)]
        memo[id(x)] = 0
        w = len(x)
        for e in (x.items() if isinstance(x, dict) else x):
            w += self.weight(e, memo)
            if w > self.max_chars:
                break
        memo[id(x)] = w
        return w

    def sized(self, x, what: str):
        w = self.weight(x)
        if w > self.max_chars:
            self.refuse(what, w)
        return x

    def check_args(self, args, kwargs, what: str) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise TemplateLimitError(f"chat template {what}: argument {a} is over max_chars={self.max_chars}")

    def check_format(self, fmt: str, what: str) -> None:
        """Widths and precisions in a %- or {}-format string: each allocates that many characters."""
        if "%" in fmt or "{" in fmt:
            for m in _NUMBER.finditer(fmt):
                if len(m.group()) >= len(str(self.max_chars)) and int(m.group()) > self.max_chars:
                    raise TemplateLimitError(f"chat template {what}: format width {m.group()} is over "
                                             f"max_chars={self.max_chars}")

    def check_binop(self, op: str, a, b) -> None:
        if op == "+":
            if isinstance(a, (str, list, tuple)) and isinstance(b, (str, list, tuple)):
                n = self.weight(a) + self.weight(b)
                if n > self.max_chars:
                    self.refuse("'+'", n)
        elif op == "*":
            for seq, k in ((a, b), (b, a)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and not isinstance(k, bool):
                    n = max(self.weight(seq), 1) * max(k, 0)
                    if n > self.max_chars:
                        self.refuse("'*'", n)
            if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"chat template '*' would build an integer over {_MAX_INT_BITS} bits")
        elif op == "**":
            if isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 0 and \
                    b * a.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"chat template '**' would build an integer over {_MAX_INT_BITS} bits")
        elif op == "%" and isinstance(a, str):
            self.check_format(a, "'%'")

    def check_method(self, obj, args) -> None:
        """String methods that multiply their input, checked before they run."""
        inner = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        s, name = getattr(inner, "__self__", None), getattr(inner, "__name__", "")
        if not isinstance(s, str):
            return
        if name in ("format", "format_map"):
            self.check_format(s, f"str.{name}")
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            n = len(s) + s.count(args[0]) * (len(args[1]) - len(args[0]))
            if n > self.max_chars:
                self.refuse("str.replace", n)
        elif name == "expandtabs" and args and isinstance(args[0], int):
            n = len(s) + s.count("\t") * max(args[0], 0)
            if n > self.max_chars:
                self.refuse("str.expandtabs", n)
        elif name == "join" and args:
            items = args[0]
            if isinstance(items, (list, tuple)):
                n = self.weight(items) + len(s) * len(items)
                if n > self.max_chars:
                    self.refuse("str.join", n)


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("ftlib_chat_template_budget", default=None)


class _Ticking:
    """A ``{% for %}`` iterable that checks the deadline at every item (keeps ``len`` for ``loop.length``)."""

    __slots__ = ("it", "budget")

    def __init__(self, it, budget: _Budget):
        self.it, self.budget = it, budget

    def __iter__(self):
        tick = self.budget.tick
        for x in self.it:
            tick()
            yield x

    def __len__(self) -> int:
        return len(self.it)  # TypeError for an iterator: jinja's loop then counts by itself


def _loop_items(iterable):
    """Wrapped around every ``{% for %}`` iterable (see ``_bounded``)."""
    b = _BUDGET.get()
    return iterable if b is None else _Ticking(iterable, b)


def _checked_concat(value):
    """Wrapped around every ``~`` concatenation: the sandbox's ``call`` hook checks the value's size."""
    return value


def _checked_set(value):
    """Wrapped around every ``{% set %}`` value (values fed back in a loop grow geometrically)."""
    return value




def _filter_precheck(b: _Budget, name: str, args) -> None:
    """Filters that multiply their input, checked before they run (args without the context ones)."""
    if name == "indent" and args and isinstance(args[0], str) and len(args) > 1:
        width = args[1]
        w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        n = len(args[0]) + (args[0].count("\n") + 1) * max(w, 0)
        if n > b.max_chars:
            b.refuse("filter 'indent'", n)
    elif name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        s, old, new = args[:3]
        n = len(s) + s.count(old) * (len(new) - len(old))
        if n > b.max_chars:
            b.refuse("filter 'replace'", n)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        sep = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        n = b.weight(args[0]) + len(sep) * len(args[0])
        if n > b.max_chars:
            b.refuse("filter 'join'", n)
    elif name == "format" and args and isinstance(args[0], str):
        b.check_format(args[0], "filter 'format'")


def _bounded_filter(name: str, f, context_types: tuple):
    what = "'{% set %}' block" if name == "set_block" else f"filter {name!r}"

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marker
    def bounded(*args, **kwargs):
        b = _BUDGET.get()
        if b is None:
            return f(*args, **kwargs)
        b.tick()
        b.check_args(args, kwargs, what)
        data = [a for a in args if not isinstance(a, context_types)]  # without a pass_context argument
        _filter_precheck(b, name, data)
        return b.sized(f(*args, **kwargs), what)

    return bounded


@lru_cache(maxsize=32)
def compile_template(template: str):
    """The compiled, bounded ``jinja2.Template`` for Jinja ``template`` text (cached by text).

    Render it through :func:`render_chat`, which sets the bounds; rendered directly, it runs
    sandboxed but unbounded."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Bounds(NodeTransformer):
        """Route every loop's iterable, ``~`` and ``{% set %}`` through the hooks below."""

        def _wrap(self, fn: str, node):
            call = nodes.Call(nodes.ImportedName(f"{__name__}.{fn}"), [node], [], None, None)
            return call.set_lineno(node.lineno)

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = self._wrap("_loop_items", node.iter)
            return node

        def visit_Concat(self, node):
            return self._wrap("_checked_concat", self.generic_visit(node))

        def visit_Assign(self, node):
            node = self.generic_visit(node)
            node.node = self._wrap("_checked_set", node.node)
            return node

        def visit_AssignBlock(self, node):  # {% set x %}...{% endset %}: the body's text, through a checking filter
            node = self.generic_visit(node)
            node.filter = nodes.Filter(node.filter, "set_block", [], [], None, None).set_lineno(node.lineno)
            return node

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def _parse(self, source, name, filename):
            tree = Bounds().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context, operator, left, right):
            b = _BUDGET.get()
            if b is None:
                return super().call_binop(context, operator, left, right)
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
                if len(left) + len(right) > b.max_chars:
                    b.refuse("'+'", len(left) + len(right))
                return left + right
            b.check_binop(operator, left, right)
            return b.sized(super().call_binop(context, operator, left, right), f"{operator!r}")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            b = _BUDGET.get()
            if b is None:
                return super().call(__context, __obj, *args, **kwargs)
            b.tick()
            what = ("'~'" if __obj is _checked_concat else "'{% set %}'" if __obj is _checked_set
                    else f"call of {getattr(__obj, '__name__', type(__obj).__name__)!r}")
            b.check_args(args, kwargs, what)
            b.check_method(__obj, args)
            return b.sized(super().call(__context, __obj, *args, **kwargs), what)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters["set_block"] = lambda text: text  # checked by _bounded_filter (see Bounds.visit_AssignBlock)
    env.filters = {k: _bounded_filter(k, f, (Context, EvalContext)) for k, f in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)
    # the tree as written (before the Bounds hooks), for content_passthrough
    compiled.ftlib_content_passthrough = _passthrough(ImmutableSandboxedEnvironment._parse(env, template, None, None))
    return compiled


_CONTENT_OPAQUE = ("FilterBlock", "Macro", "CallBlock", "AssignBlock", "ScopedEvalContextModifier",
                   "EvalContextModifier", "With")


_LOOP_ATTRS = ("index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0")


def _passthrough(tree) -> bool:
    """True iff message contents reach the output only as whole ``{{ m['content'] }}`` expressions.

    Conservative syntactic check of a parsed template: ``messages`` appears only as the iterable of
    ``{% for m in messages %}`` loops (any other use, ``messages[0]``, ``messages | length``, is a no);
    each such loop name ``m`` is never rebound and is used only as ``m['key']`` / ``m.key`` (no dict
    methods, no ``m`` alone); ``loop`` is used only for its counters (``loop.previtem`` reaches another
    message); ``m['content']`` / ``m.content`` appears only as a whole output
    expression (not in a test, filter, concatenation, ``set``, macro, call or filter block)."""
    from jinja2 import nodes

    loops = [f for f in tree.find_all(nodes.For) if isinstance(f.iter, nodes.Name) and f.iter.name == "messages"]
    if not loops or any(not isinstance(f.target, nodes.Name) or f.recursive for f in loops):
        return False
    names = {f.target.name for f in loops}
    targets = {id(f.target) for f in loops}
    iters = {id(f.iter) for f in loops}

    def ok(node, parent, grandparent, opaque: bool) -> bool:
        if isinstance(node, nodes.Name) and (node.name in names or node.name == "messages"):
            if node.ctx != "load":
                return id(node) in targets
            if node.name == "messages" and node.name not in names:
                return id(node) in iters
            if isinstance(parent, nodes.Getitem) and parent.node is node and isinstance(parent.arg, nodes.Const) \
                    and isinstance(parent.arg.value, str):
                key = parent.arg.value
            elif isinstance(parent, nodes.Getattr) and parent.node is node and not hasattr(dict, parent.attr):
                key = parent.attr
            else:
                return False
            if key == "content":
                return not opaque and isinstance(grandparent, nodes.Output) and any(x is parent
                                                                                     for x in grandparent.nodes)
            return True
        if isinstance(node, nodes.Name) and node.name == "loop":  # loop.previtem / nextitem reach other messages
            return isinstance(parent, nodes.Getattr) and parent.node is node and parent.attr in _LOOP_ATTRS
        name = type(node).__name__
        generation = (isinstance(node, nodes.CallBlock) and isinstance(node.call, nodes.Call)
                      and isinstance(node.call.node, nodes.ExtensionAttribute) and node.call.node.name == "_body")
        inner = opaque or (name in _CONTENT_OPAQUE and not generation)
        return all(ok(child, node, parent, inner) for child in node.iter_child_nodes())

    return ok(tree, None, None, False)


def content_passthrough(template: str) -> bool:
    """Whether ``template`` writes each message's content only as is (see ``_passthrough``).

    Then a conversation whose contents are wrapped in marker characters renders as the plain
    conversation with the markers around each content written, and nothing else differs: the
    control flow cannot see the contents. ``ftlib.data``'s formatter uses it to render such a
    template once per record instead of twice (marked, then plain to compare)."""
    return compile_template(template_text(template)).ftlib_content_passthrough


def render_chat(messages: list[dict], template: str, *, add_generation_prompt: bool = False,
                max_seconds: float = DEFAULT_MAX_SECONDS, max_chars: int = DEFAULT_MAX_CHARS,
                **variables: Any) -> str:
    """Render ``messages`` ([{"role", "content"}, ...]) with a chat ``template`` (a built-in name or
    Jinja text), sandboxed and bounded (see the module docstring); ``variables`` are extra template
    variables (``bos_token``, ``eos_token``, ``tools``, ...)."""
    budget = _Budget(max_seconds, max_chars)
    token = _BUDGET.set(budget)
    try:
        compiled = compile_template(template_text(template))
        out, n, limit = [], 0, budget.max_chars
        # the size of the output so far, at every piece (time is checked by the loop and call hooks:
        # without a loop a template writes no more pieces than its own text holds)
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            n += len(piece)
            if n > limit:
                budget.refuse("output", n)
            out.append(piece)
        return "".join(out)
    except MemoryError:
        raise TemplateLimitError(f"chat template ran out of memory while rendering (after {budget.elapsed():.2f} s; "
                                 f"max_chars={budget.max_chars})") from None
    finally:
        _BUDGET.reset(token)
