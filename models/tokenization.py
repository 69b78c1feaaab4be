"""The tokenizer every task builds from its config (ALBEF uses the BertTokenizer of `text_encoder`)."""

from __future__ import annotations

import os
from typing import Any

from transformers import BertTokenizerFast

from grit_io import InputFileError

__all__ = ["build_tokenizer", "tokenizer_from_vocab"]


def tokenizer_from_vocab(vocab_file: str) -> BertTokenizerFast:
    """BertTokenizerFast over a local WordPiece vocab.txt; errors if the file is missing or not fully read."""
    if not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"config key 'vocab_file': no such file: {vocab_file}")
    with open(vocab_file, encoding="utf-8") as f:
        n_tokens = len({line.rstrip("\n") for line in f if line.strip()})
    tokenizer = BertTokenizerFast(vocab_file=vocab_file, do_lower_case=True)
    # transformers 5 silently ignores vocab_file (the requirements pin 4.x); never train on [UNK]s.
    if len(tokenizer) < n_tokens:
        raise InputFileError(f"vocab_file {vocab_file}: the tokenizer read {len(tokenizer)} tokens, the file "
                             f"has {n_tokens}")
    return tokenizer


def build_tokenizer(config: Any) -> BertTokenizerFast:
    """The BERT tokenizer of config.vocab_file (a vocab.txt) or else of config.text_encoder.

    config: the resolved task config (training.config.TaskConfig); reads vocab_file and text_encoder.
    """
    if config.vocab_file:
        return tokenizer_from_vocab(config.vocab_file)
    if not config.text_encoder:
        # Each key is optional on its own (text_encoder null: random BERT weights); the tokenizer needs one.
        raise ValueError("config needs 'vocab_file' or 'text_encoder' to build the tokenizer")
    try:
        return BertTokenizerFast.from_pretrained(config.text_encoder)
    except OSError as err:
        raise FileNotFoundError(
            f"config key 'text_encoder': could not load a tokenizer from {config.text_encoder!r} "
            "(a local directory with vocab.txt, or a hub id reachable from this machine)"
        ) from err
