"""Writers of the document formats `data encode` and `tokenizer train` read, shared by their tests."""

from __future__ import annotations

import json

import pytest


def write_jsonl(path, documents, field="text", opener=open):
    """One JSON object a line: {"id": i, field: document}."""
    with opener(path, "wt", encoding="utf-8") as handle:
        for index, document in enumerate(documents):
            handle.write(json.dumps({"id": index, field: document}) + "\n")
    return path


def write_zst(path, data: bytes):
    zstandard = pytest.importorskip("zstandard")
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


def write_parquet(path, documents, column="text", row_group_size=3):
    """An "id" column and the documents' column, in row groups small enough that a reader crosses them."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(documents))), column: documents}), path,
                   row_group_size=row_group_size)
    return path
