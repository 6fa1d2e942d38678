"""Sandboxed rendering of chat templates (the Jinja text in tokenizer_config.json).

Chat templates are untrusted code that came with a checkpoint or dataset, so they run in
jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no
mutation of passed-in objects), configured as Hugging Face ``transformers`` renders them:
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not HTML-escape, the ``raise_exception`` and ``strftime_now`` globals, and the
``{% generation %}...{% endgeneration %}`` tag (used by HF to track assistant spans; here it
renders its body). Rendering the same template text with ftlib and with ``transformers``
therefore gives the same string.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

__all__ = ["compile_template"]


@lru_cache(maxsize=32)
def compile_template(template: str):
    """The compiled ``jinja2.Template`` for ``template`` text (cached by text)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
