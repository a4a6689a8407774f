"""Small bundled training texts for tests and the demo (provenance and licences in README.md).

- `prose_files()`: two public-domain prose texts (~1.5 MB): tiny-shakespeare and Frankenstein.
- `chat_file()`: 800 conversations in smol-smoltalk's `messages` shape (Apache-2.0 / MIT sources).

They are substitutes for FineWeb-Edu and smol-smoltalk, which live on the Hugging Face Hub only:
large enough to show a tiny model learning, small enough to ship inside the wheel.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["chat_file", "prose_files"]

CORPUS_DIR = Path(__file__).resolve().parent


def prose_files() -> list[Path]:
    """The bundled prose texts (UTF-8 `.txt`), in a fixed order."""
    return sorted((CORPUS_DIR / "prose").glob("*.txt"))


def chat_file() -> Path:
    """The bundled chat sample: JSONL, one `{"messages": [{"role", "content"}, ...]}` per line."""
    return CORPUS_DIR / "chat" / "chat_sample.messages.jsonl"
