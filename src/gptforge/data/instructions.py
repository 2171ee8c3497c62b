"""Instruction and preference data from local JSON / JSONL files, as plain records.

Formats (`auto` tells them apart by their keys, record by record):

- `alpaca`: {"instruction", "input" (optional), "output", "system" (optional)} → a user turn
  (instruction, a blank line, input) and an assistant turn;
- `messages`: {"messages": [{"role": system|user|assistant, "content"}, ...]} (multi-turn);
- `sharegpt`: {"conversations": [{"from": system|human|gpt (or user/assistant), "value"}, ...]};
- `prompt_completion`: {"prompt", "completion"}: plain text, no template, loss on the completion;
- `preference`: {"prompt", "chosen", "rejected"}: strings are plain text; a `prompt` given as a
  list of messages goes through the chat template, and `chosen` / `rejected` may then be a
  one-message assistant list (TRL's conversational layout).

A file is a JSON array or JSON Lines. Every bad record is a `DataError` of one line naming
`file:line` and the field.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from gptforge.data.chat_template import check_messages
from gptforge.errors import ConfigError, DataError

FORMATS = ("auto", "alpaca", "messages", "sharegpt", "prompt_completion", "preference")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class Record:
    """One example: a conversation (`messages`), or plain `prompt` + `completion` text, or a
    preference pair (`prompt` as text or messages, `chosen`, `rejected`). `where` = file:line."""

    where: str
    messages: list[dict] | None = None
    prompt: str | list[dict] | None = None
    completion: str | None = None
    chosen: str | None = None
    rejected: str | None = None


def _rows(path: Path):
    """(line number, object) for a JSON array file or a JSON Lines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise DataError(f"{path}:{getattr(e, 'lineno', 1)}: not valid JSON ({e})") from None
        # A JSON array has no line per record: report the record's index (1-based) as its line.
        yield from enumerate(items, 1)
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e})") from None


def _str(obj: dict, key: str, where: str, optional: bool = False) -> str:
    v = obj.get(key)
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise DataError(f"{where}: field '{key}' must be a string" + (" (it is missing)" if v is None else ""))
    return v


def detect(obj: dict) -> str:
    """The format of one record by its keys ('' if none fits)."""
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "chosen" in obj or "rejected" in obj:
        return "preference"
    if "instruction" in obj or "output" in obj:
        return "alpaca"
    if "completion" in obj:
        return "prompt_completion"
    return ""


def _alpaca(obj: dict, where: str) -> Record:
    instruction, extra = _str(obj, "instruction", where), _str(obj, "input", where, optional=True)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": _str(obj, "output", where)}]
    system = _str(obj, "system", where, optional=True)
    return Record(where, messages=([{"role": "system", "content": system}] if system else []) + messages)


def _sharegpt(obj: dict, where: str) -> Record:
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list of {{from, value}} objects")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("from") not in _SHAREGPT_ROLES:
            got = t.get("from") if isinstance(t, dict) else t
            raise DataError(f"{where}: conversations[{i}].from is {got!r}; expected one of system, human, gpt")
        if not isinstance(t.get("value"), str):
            raise DataError(f"{where}: conversations[{i}].value must be a string")
        messages.append({"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return Record(where, messages=messages)


def _answer(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], dict) and v[0].get("role") == "assistant":
        v = v[0].get("content")
    if not isinstance(v, str):
        raise DataError(f"{where}: field '{key}' must be a string (or one assistant message)")
    return v


def _preference(obj: dict, where: str) -> Record:
    prompt = obj.get("prompt")
    if isinstance(prompt, list):
        prompt = check_messages(prompt, f"{where}: field 'prompt'")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: field 'prompt' must be a string or a list of messages")
    return Record(where, prompt=prompt, chosen=_answer(obj, "chosen", where), rejected=_answer(obj, "rejected", where))


def parse(obj, fmt: str, where: str) -> Record:
    """One JSON object → a `Record` in format `fmt` (or its detected format under `auto`)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    kind = detect(obj) if fmt == "auto" else fmt
    if kind == "messages":
        return Record(where, messages=check_messages(obj.get("messages"), f"{where}: field 'messages'"))
    if kind == "sharegpt":
        return _sharegpt(obj, where)
    if kind == "alpaca":
        return _alpaca(obj, where)
    if kind == "prompt_completion":
        return Record(where, prompt=_str(obj, "prompt", where), completion=_str(obj, "completion", where))
    if kind == "preference":
        return _preference(obj, where)
    raise DataError(f"{where}: no known fields (instruction/output, messages, conversations, prompt/completion, "
                    f"prompt/chosen/rejected); keys are {sorted(obj)[:6]}")


def _check_kind(rec: Record, preference: bool) -> None:
    if preference and rec.chosen is None:
        raise DataError(f"{rec.where}: a preference record needs fields 'prompt', 'chosen' and 'rejected'")
    if not preference and rec.chosen is not None:
        raise DataError(f"{rec.where}: a preference record (chosen/rejected) in instruction data; "
                        "train on it with `gptforge dpo`")
    if rec.messages is not None and not any(m["role"] == "assistant" for m in rec.messages):
        raise DataError(f"{rec.where}: field 'messages' has no assistant turn to learn from")


def read_records(paths, fmt: str = "auto", preference: bool = False, key: str = "Instruct.train_data") -> list[Record]:
    """Every record of the files `paths` (a path or a list of paths), checked."""
    if fmt not in FORMATS:
        raise ConfigError(f"Instruct.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths or [])
    if not paths:
        raise ConfigError(f"{key}: give the data file(s) (JSON or JSONL)")
    out = []
    for p in map(Path, paths):
        if not p.is_file():
            raise DataError(f"{key}: {p}: file not found")
        for n, obj in _rows(p):
            rec = parse(obj, fmt, f"{p}:{n}")
            _check_kind(rec, preference)
            out.append(rec)
    if not out:
        raise DataError(f"{key}: {', '.join(map(str, paths))}: no records")
    return out


def split_records(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, validation): a seeded random `fraction` of the records held out (at least one when
    fraction > 0)."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"Instruct.eval_fraction: {fraction} must be in [0, 1)")
    if fraction == 0.0:
        return records, []
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n = max(1, round(fraction * len(records)))
    if n >= len(records):
        raise DataError(f"Instruct.eval_fraction: {fraction} of {len(records)} records leaves nothing to train on")
    held = set(order[:n])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def read_conversations(path: str | Path, key: str = "--messages") -> list[tuple[str, list[dict]]]:
    """(file:line, messages) of every `{"messages": [...]}` record of a JSON Lines file (or a
    JSON array): the conversations `gptforge generate --chat` answers. A bad record is one
    `DataError` naming file:line and the field; other keys of a record are ignored."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{key} {p}: file not found")
    out = []
    for n, obj in _rows(p):
        where = f"{p}:{n}"
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a record must be a JSON object with a 'messages' field, got {type(obj).__name__}")
        if "messages" not in obj:
            raise DataError(f"{where}: field 'messages' is missing (a record is {{\"messages\": [{{\"role\": ..., "
                            f"\"content\": ...}}, ...]}}); keys are {sorted(obj)[:6]}")
        out.append((where, check_messages(obj["messages"], f"{where}: field 'messages'")))
    if not out:
        raise DataError(f"{key} {p}: no records; give one {{\"messages\": [...]}} object per line")
    return out
