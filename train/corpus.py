"""Plain-text corpora for pretraining, packed into fixed-length sequences.

    train, val = corpus_documents("stdlib", val_fraction=0.02)         # this Python's standard library
    train, val = corpus_documents("data/*.jsonl", column="text")        # local text / jsonl / json / parquet
    train, val = corpus_documents("hub:wikitext@wikitext-103-raw-v1", split="train", column="text")
    seqs = pack(tokenize(tokenizer, train), seq_len=512, eos_id=2)       # [N, 512] int64
    seqs = packed_corpus(tokenizer, "stdlib", seq_len=512, cache_dir=...)  # the same, cached on disk
    tokenizer = train_tokenizer(train, vocab_size=8192, folder=out / "tokenizer")  # BPE for a small model

The default corpus is the source of the running interpreter's standard library: real code that
every machine has. Its held-out split is by file (a stable hash of the relative path), so no
validation prompt comes from a file the model trained on. Other sources split by record.
Documents are joined with the end-of-text token between them and cut into sequences of seq_len
tokens; the remainder at the end is dropped.
"""

import glob
import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from specdec_runtime.errors import SpecdecError
from train.data import load_hub_dataset

TEXT_EXTENSIONS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class Document(NamedTuple):
    id: str  # a file's relative path, or a record's index
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _held_out(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _stdlib_documents(max_documents: int | None) -> list[Document]:
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise SpecdecError(f"no Python files under {root}: point data.corpus at a text corpus instead")
    docs = [Document(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace")) for p in files]
    return docs[:max_documents] if max_documents else docs


def _records(source: str, split: str, column: str) -> list[Document]:
    if source.startswith("hub:"):
        ds = load_hub_dataset(source, split)
    else:
        import datasets

        files = sorted(glob.glob(str(Path(source).expanduser())))
        if not files:
            raise SpecdecError(f"data.corpus='{source}': no such file (a path or glob of .txt/.jsonl/.json/.parquet)")
        kinds = {TEXT_EXTENSIONS.get(Path(f).suffix) for f in files}
        if None in kinds or len(kinds) > 1:
            raise SpecdecError(f"data.corpus='{source}': use files of one kind among {', '.join(TEXT_EXTENSIONS)}")
        ds = datasets.load_dataset(kinds.pop(), data_files=files, split="train")
    if column not in ds.column_names:
        raise SpecdecError(f"corpus '{source}' has no column '{column}' (it has {ds.column_names}): set data.column")
    return [Document(str(i), t) for i, t in enumerate(ds[column]) if t]


def corpus_documents(
    source: str,
    *,
    split: str = "train",
    column: str = "text",
    val_fraction: float = 0.02,
    max_documents: int | None = None,
) -> tuple[list[Document], list[Document]]:
    """(train, held-out) documents of `stdlib`, a local file/glob, or hub:ID[@SUBSET]."""
    if not 0 < val_fraction < 1:
        raise SpecdecError(f"data.val_fraction={val_fraction} must be in (0, 1)")
    if source == "stdlib":
        docs = _stdlib_documents(max_documents)
    else:
        docs = _records(source, split, column)
        docs = docs[:max_documents] if max_documents else docs
    if not docs:
        raise SpecdecError(f"corpus '{source}' is empty")
    train = [d for d in docs if not _held_out(d.id, val_fraction)]
    val = [d for d in docs if _held_out(d.id, val_fraction)]
    if not train or not val:
        raise SpecdecError(
            f"corpus '{source}' has {len(docs)} documents: too few for a held-out split of {val_fraction}"
        )
    return train, val


def tokenize(tokenizer: Any, docs: list[Document], batch: int = 64, progress: bool = True) -> list[list[int]]:
    ids: list[list[int]] = []
    for i in tqdm(range(0, len(docs), batch), desc="tokenize", unit="batch", disable=not progress):
        ids += tokenizer([d.text for d in docs[i : i + batch]], add_special_tokens=False)["input_ids"]
    return ids


def pack(docs: list[list[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Documents joined by eos_id and cut into [N, seq_len] (the incomplete tail dropped)."""
    flat = torch.tensor([t for d in docs for t in (*d, eos_id)], dtype=torch.long)
    n = flat.numel() // seq_len
    if n == 0:
        raise SpecdecError(f"the corpus has {flat.numel()} tokens, fewer than one sequence of {seq_len}")
    return flat[: n * seq_len].view(n, seq_len)


def packed_corpus(
    tokenizer: Any,
    source: str,
    *,
    seq_len: int,
    cache_dir: Path | None,
    split: str = "train",
    column: str = "text",
    val_fraction: float = 0.02,
    max_documents: int | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(train [N, seq_len], val [M, seq_len], info) for a corpus, cached by source + tokenizer + settings."""
    from safetensors.torch import load_file, save_file

    settings = dict(
        source=source,
        split=split,
        column=column,
        val_fraction=val_fraction,
        max_documents=max_documents,
        seq_len=seq_len,
        tokenizer=hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16],
        eos=tokenizer.eos_token_id,
    )
    if source == "stdlib":
        settings["stdlib"] = str(stdlib_root())
    elif not source.startswith("hub:"):
        settings["files"] = [(f, Path(f).stat().st_size) for f in sorted(glob.glob(str(Path(source).expanduser())))]
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    file = cache_dir / f"{key}.safetensors" if cache_dir is not None else None
    if file is not None and file.is_file():
        t = load_file(str(file))
        return t["train"], t["val"], json.loads((cache_dir / f"{key}.json").read_text())
    train, val = corpus_documents(
        source, split=split, column=column, val_fraction=val_fraction, max_documents=max_documents
    )
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SpecdecError(f"tokenizer {tokenizer.name_or_path} has no eos token to separate documents")
    seqs = {
        "train": pack(tokenize(tokenizer, train, progress=progress), seq_len, eos),
        "val": pack(tokenize(tokenizer, val, progress=progress), seq_len, eos),
    }
    info = settings | {"train_documents": len(train), "val_documents": len(val), "val_ids": [d.id for d in val]}
    if file is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        save_file(seqs, str(tmp))
        (cache_dir / f"{key}.json").write_text(json.dumps(info))
        tmp.rename(file)
    return seqs["train"], seqs["val"], info


def train_tokenizer(docs: list[Document], vocab_size: int, folder: Path) -> Any:
    """A byte-level BPE tokenizer of vocab_size tokens trained on docs (HF tokenizers), saved to
    folder; a small vocabulary keeps a small pretrained model's vocabulary projection cheap."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast
