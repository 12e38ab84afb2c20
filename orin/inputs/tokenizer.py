"""The checkpoint's tokenizer through the `tokenizers` library, set up the way transformers' fast tokenizer
(TokenizersBackend, `PreTrainedTokenizerFast.from_pretrained`) sets it up from the same files, so that a prompt
encodes to the same ids and ids decode to the same text:

- tokenizer.json as the backend; truncation and padding off (the processor never truncates, and one prompt has
  nothing to pad to);
- tokenizer_config.json's named special tokens (bos/eos/unk/sep/pad/cls/mask), its model-specific ones (every
  other `*_token` key, `extra_special_tokens` given as a dict, `model_specific_special_tokens`), its extra ones
  (`extra_special_tokens`/`additional_special_tokens` as a list) and its `added_tokens_decoder`: whatever of these
  the backend lacks is added, as transformers adds it (special tokens in the text then stay whole);
  special_tokens_map.json is read, as legacy, only when tokenizer_config.json has no added_tokens_decoder;
- tokenizer.json's post-processor as it is: transformers drops tokenizer_config.json's add_bos_token and
  add_eos_token when tokenizer.json exists (and the template it puts in place of a missing post-processor adds
  nothing); `split_special_tokens` honoured;
- decoding by the backend, special tokens skipped on request; tokenization-space clean-up only where transformers
  applies it (asked for, and not a BPE model).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from ..errors import ModelError
from .checkpoint_files import optional_json, require_file

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(value, *, special: bool | None = None) -> AddedToken:
    fields = {k: value[k] for k in _TOKEN_FIELDS if k in value}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _token_value(value):
    """A special-token entry of tokenizer_config.json: a string, or an AddedToken serialised as a dict."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return _added_token(value)
    return value if isinstance(value, str) else None


def _clean_up_tokenization(text: str) -> str:
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


class Tokenizer:
    """Encode a rendered prompt, decode generated ids; `special_tokens` are the names the chat template sees."""

    def __init__(self, backend: Backend, config: dict):
        self.backend = backend
        self.backend.no_truncation()
        self.backend.no_padding()
        named, extra = _special_tokens(config)
        self.special_tokens = {k: str(v) for k, v in named.items() if v is not None}
        self._add_missing(config, named, extra)
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = require_file(model_dir, "tokenizer.json")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # the Rust side raises bare Exceptions for every parse error
            raise ModelError(f"cannot load {path}: {exc}; restore tokenizer.json from the model's release") from exc
        config = optional_json(model_dir, "tokenizer_config.json")
        if "added_tokens_decoder" not in config:
            config = {**config, **optional_json(model_dir, "special_tokens_map.json")}
        return cls(backend, config)

    def _add_missing(self, config: dict, named: dict, extra: list) -> None:
        """Add what tokenizer_config.json declares and the backend lacks, in transformers' order and form."""
        have = {repr(t) for t in self.backend.get_added_tokens_decoder().values()}
        declared = config.get("added_tokens_decoder") or {}
        to_add = [_added_token(declared[k]) for k in sorted(declared, key=int)
                  if repr(_added_token(declared[k])) not in have]
        known = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        known |= {t.content for t in to_add}
        for value in [*named.values(), *extra]:
            if value is None:
                continue
            content = value if isinstance(value, str) else value.content
            if content not in known:
                to_add.append(value)
                known.add(content)
        named_contents = {v if isinstance(v, str) else v.content for v in named.values() if v is not None}
        tokens = []
        for tok in to_add:
            if isinstance(tok, str):
                tok = AddedToken(tok, special=True)
            elif not tok.special and tok.content in named_contents:
                tok.special = True
            tokens.append(tok)
        if tokens:
            self.backend.add_tokens(tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, special tokens written in it recognised as such (transformers' default)."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text


def _special_tokens(config: dict) -> tuple[dict, list]:
    """tokenizer_config.json's named special tokens (standard names first, then the model's own) and its extra
    special tokens, as transformers reads them."""
    named = {k: _token_value(config.get(k)) for k in NAMED_SPECIAL_TOKENS}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    model_specific = {k: _token_value(v) for k, v in config.items()
                      if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS and _token_value(v) is not None}
    if isinstance(extra, dict):
        model_specific.update({k: _token_value(v) for k, v in extra.items()})
        extra = []
    model_specific.update({k: _token_value(v) for k, v in (config.get("model_specific_special_tokens") or {}).items()})
    named.update(model_specific)
    # A named token that added_tokens_decoder also lists takes that entry's properties.
    declared = {d["content"]: d for d in (config.get("added_tokens_decoder") or {}).values()
                if isinstance(d, dict) and "content" in d}
    for key in NAMED_SPECIAL_TOKENS:
        value = named[key]
        content = value if isinstance(value, str) else getattr(value, "content", None)
        if content in declared:
            named[key] = _added_token(declared[content])
    extra = [t for t in (_token_value(v) for v in extra) if t is not None]
    return named, extra
