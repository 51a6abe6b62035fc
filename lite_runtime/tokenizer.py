"""The folder's tokenizer, read with the `tokenizers` library alone.

Why not transformers' AutoTokenizer: importing transformers imports torch when it is installed,
2-4 s on a small machine, longer than loading and compiling the graph a short prompt needs (and
a deployment box should not need torch). Qwen2's tokenizer in transformers is a thin layer over
the same `tokenizer.json`, so this class gives the same ids and text for what the runtime uses:
`tok(text)["input_ids"]`, `encode`, `decode`/`batch_decode` (with `skip_special_tokens`), and
`apply_chat_template`, rendered with jinja2 the way transformers renders it; a BOS/EOS token as
tokenizer_config.json's add_bos_token / add_eos_token ask (Llama). tests/test_tokenizer.py
holds it to AutoTokenizer on the same folder. Anything else: pass `tokenizer=` to pipeline.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence

from lite_runtime.errors import InferError, MissingDependencyError

# transformers' clean_up_tokenization, used only when tokenizer_config.json asks for it (Qwen2's does not)
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


JINJA2_MISSING = "rendering the chat template needs jinja2, which cannot be imported here: pip install jinja2"
NO_CHAT_TEMPLATE = "the tokenizer has no chat template"


def chat_problem(tokenizer) -> Optional[InferError]:
    """Why `tokenizer` cannot render chat messages, or None: no chat template (the model has no chat format: an
    InferError, the caller's to avoid), or jinja2 missing (a MissingDependencyError: this machine's to fix). Any
    tokenizer: ours renders with jinja2, and so does transformers'."""
    if not getattr(tokenizer, "chat_template", None):
        return InferError(NO_CHAT_TEMPLATE)
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return MissingDependencyError(JINJA2_MISSING)
    return None


def has_folder_tokenizer(path: Optional[str]) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))


class FolderTokenizer:
    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InferError("reading the folder's tokenizer needs the tokenizers package (pip install tokenizers), "
                             "or pass tokenizer=...") from None
        file = os.path.join(path, "tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # noqa: BLE001  (tokenizers raises its own Exception subclass)
            raise InferError(f"{file}: not a tokenizer the tokenizers library reads ({exc}); re-export the folder "
                             "or pass tokenizer=...") from None
        config: Dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as fh:
                    config = json.load(fh)
            except (OSError, ValueError) as exc:
                raise InferError(f"{config_path}: unreadable ({exc}); re-export the folder") from None
        self.special_tokens = {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS}
        for key, text in self.special_tokens.items():
            setattr(self, key, text)
            setattr(self, f"{key}_id", self._tok.token_to_id(text) if text else None)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._set_special_token_template(config)
        template_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as fh:
                self.chat_template: Optional[str] = fh.read()
        else:
            template = config.get("chat_template")
            self.chat_template = template if isinstance(template, str) else None
        self._template = None

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Dict[str, List[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def _set_special_token_template(self, config: Dict[str, Any]) -> None:
        """Llama-style tokenizers: tokenizer_config.json's add_bos_token / add_eos_token, when present, decide whether
        encode adds BOS / EOS, and the template is rebuilt once here from them (as transformers'
        update_post_processor does); a flag that is absent keeps what tokenizer.json's own template does. Without
        either flag tokenizer.json's post-processor is left alone (Llama 3 and Qwen ship theirs there)."""
        wanted = {}
        for key, token_id in (("add_bos_token", self.bos_token_id), ("add_eos_token", self.eos_token_id)):
            value = config.get(key)
            if isinstance(value, bool) and (token_id is not None or not value):
                wanted[key] = value
        if not wanted:
            return
        from tokenizers.processors import TemplateProcessing

        probe = "a"
        ids, plain = self._tok.encode(probe).ids, self._tok.encode(probe, add_special_tokens=False).ids
        add_bos = wanted.get("add_bos_token", ids[:1] == [self.bos_token_id] != plain[:1])
        add_eos = wanted.get("add_eos_token", ids[-1:] == [self.eos_token_id] != plain[-1:])
        specials = [(self.bos_token, self.bos_token_id)] * add_bos + [(self.eos_token, self.eos_token_id)] * add_eos
        single = " ".join([f"{self.bos_token}:0"] * add_bos + ["$A:0"] + [f"{self.eos_token}:0"] * add_eos)
        self._tok.post_processor = TemplateProcessing(single=single, special_tokens=specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    @property
    def backend_tokenizer(self):
        """The tokenizers.Tokenizer underneath, under transformers' name for it (its JSON, its vocabulary)."""
        return self._tok

    def batch_decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool = False, **kw: Any) -> List[str]:
        return [self.decode(r, skip_special_tokens=skip_special_tokens, **kw) for r in rows]

    def apply_chat_template(self, messages: List[Dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any):
        """The chat template rendered as transformers renders it (sandboxed jinja2, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise InferError(f"{NO_CHAT_TEMPLATE}; drop apply_chat_template / --chat")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        values = {k: v for k, v in self.special_tokens.items() if v is not None}
        values.update(kwargs)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **values)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile_template(source: str):
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise MissingDependencyError(JINJA2_MISSING) from None

    def raise_exception(message: str):
        raise InferError(f"chat template: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
