"""The checkpoint's chat template rendered with jinja2 the way transformers renders it
(transformers.utils.chat_template_utils), so the prompt text is the same string:

- an ImmutableSandboxedEnvironment (templates come from the hub: untrusted code) with trim_blocks and
  lstrip_blocks, the loop-controls extension and a `{% generation %}` block that renders its body;
- `raise_exception(message)`, `strftime_now(format)`, a `tojson` that does not escape HTML and takes
  ensure_ascii/indent/separators/sort_keys, and the restricted `dict` and `namespace` globals;
- the variables: messages, tools, documents, add_generation_prompt and the tokenizer's named special tokens
  (eos_token, pad_token, image_token, ...);
- the messages as plain data: keys whose value is None dropped, anything not JSON-like replaced by "<TypeName>",
  reasoning under any of its names also given as reasoning_content and thinking.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InputError, ModelError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in a template without the dict type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore names, the way into CPython internals."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's own signature trick: `namespace(self=...)` must work)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelError(f"the checkpoint's chat template does not parse (line {exc.lineno}: {exc.message}); "
                         "restore chat_template.jinja from the model's release") from exc


def plain_data(value):
    """`value` rebuilt from JSON types only: a template never sees an object with methods (images, arrays)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if isinstance(value, np.generic):
        return plain_data(value.item())  # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())  # pydantic models
    return f"<{type(value).__name__}>"


def _message(msg) -> dict:
    if not isinstance(msg, Mapping):
        raise InputError(f"a chat message must be a mapping with role and content, not {type(msg).__name__}")
    msg = plain_data({k: v for k, v in msg.items() if v is not None})
    reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


class ChatTemplate:
    """One checkpoint's template, compiled once."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.template = _compile(source)
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages, *, add_generation_prompt: bool = False, tools=None, documents=None,
               **variables) -> str:
        """The prompt text of one conversation; `variables` override the special-token names."""
        chat = [_message(m) for m in messages]
        extra = plain_data({**self.special_tokens, **variables})
        try:
            return self.template.render(messages=chat, tools=plain_data(tools), documents=plain_data(documents),
                                        add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.exceptions.TemplateError as exc:
            raise InputError(f"the chat template refused the conversation: {exc}") from exc
