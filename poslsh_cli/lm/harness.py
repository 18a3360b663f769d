"""A checkpoint as an lm-evaluation-harness model: :class:`PoslshLM` is lm-eval's own ``HFLM``
(its tokenisation, batching, scoring and generation, unchanged) around the model
:func:`~poslsh_cli.lm.loading.load_model` gives, under the checkpoint's position scheme or one
swapped in (:func:`~poslsh_cli.lm.loading.with_scheme`).

Registered as ``poslsh`` in lm-eval's model registry when this module is imported, and declared as
the ``poslsh`` entry point of the ``lm_eval.models`` group, which lm-eval versions with plugin
discovery read (``lm_eval run --model poslsh --model_args pretrained=CKPT,attention=poslsh,s=8``).
``poslsh eval`` (:mod:`poslsh_cli.experiments.eval.command`) runs it with any lm-eval version, and so does
lm-eval's own command line started through this module (``python -m poslsh_cli.lm.harness run
--model poslsh ...``).

A byte-level checkpoint (``poslsh train`` from scratch) has no tokenizer of its own; it gets
:func:`byte_tokenizer`: one token per UTF-8 byte, id = the byte, the NUL byte as end-of-text and
padding, and a newline as the prefix token of an empty context (documents are separated by blank
lines in training).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lm_eval.api.registry import model_registry
from lm_eval.models.huggingface import HFLM
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.checkpoint import load_tokenizer
from poslsh_cli.lm.convert import has_tokenizer
from poslsh_cli.lm.loading import load_model, with_scheme

#: the end-of-text token of :func:`byte_tokenizer` (the NUL byte, absent from text)
END_OF_TEXT = "<|endoftext|>"
NEWLINE = 10


def byte_tokenizer() -> Any:
    """A fast tokenizer whose ids are the UTF-8 bytes of the text (vocabulary 256; id 0, the NUL
    byte, is :data:`END_OF_TEXT`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = byte_characters()
    vocab = {table[b]: b for b in range(1, 256)}
    vocab[END_OF_TEXT] = 0
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   clean_up_tokenization_spaces=False)


def byte_characters() -> dict[int, str]:
    """The byte-level pre-tokenizer's character for each byte (GPT-2's table: printable Latin-1
    bytes stand for themselves, the others for the characters from U+0100 on, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


class PoslshLM(HFLM):
    """lm-eval's ``HFLM`` on a poslsh checkpoint: ``pretrained`` (a checkpoint directory),
    ``attention`` (``own`` or a scheme swapped in: alibi, poslsh, windowed, fixed_block, none;
    ``rope`` only for a RoPE checkpoint), ``s`` (masks per head for Positional LSH; 0: the
    checkpoint's own), ``seed`` (the mask draw; default the checkpoint's own), ``sampler`` (how
    Positional-LSH masks are drawn: iid, stratified, sobol) and ``backend`` (the attention path;
    both default to the checkpoint's own), ``device`` (None: CUDA when present); every other
    argument is ``HFLM``'s (batch_size, max_length, ...)."""

    def __init__(self, pretrained: str, attention: str = "own", s: int = 0, seed: Optional[int] = None,
                 device: Optional[str] = None, trust_remote_code: bool = False, sampler: Optional[str] = None,
                 backend: Optional[str] = None, **kwargs: Any) -> None:

        if not isinstance(pretrained, (str, Path)):
            raise ConfigError("pretrained= is a checkpoint directory (poslsh train's final/, or any causal LM)")
        path = Path(pretrained)
        import torch

        where = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if where.startswith("cuda") and not torch.cuda.is_available():  # lm-eval's CLI asks for cuda unless told
            raise ConfigError(f"device={where} but CUDA is not available (give device=cpu: --device cpu)")
        model, own = load_model(path, where, trust_remote_code=bool(trust_remote_code))
        self.poslsh_state = with_scheme(model, own, str(attention), int(s or 0),
                                        None if seed in (None, "") else int(seed), path,
                                        sampler=sampler or None, backend=backend or None)
        if has_tokenizer(path):

            tokenizer = load_tokenizer(path)
        else:
            tokenizer = byte_tokenizer()
            kwargs.setdefault("prefix_token_id", NEWLINE)
        kwargs.pop("dtype", None)  # the checkpoint's own precision
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
        self.poslsh_path = path

    def _model_call(self, inps: Any, attn_mask: Any = None, labels: Any = None) -> Any:
        """Logits of a batch scored in one forward pass, without building a key/value cache."""
        if attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        import torch

        with torch.no_grad():
            return self.model(inps, use_cache=False).logits


if "poslsh" not in model_registry:  # an lm-eval with plugin discovery has it as an entry point already
    model_registry.register("poslsh")(PoslshLM)


if __name__ == "__main__":  # lm-eval's own command line with the poslsh model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
