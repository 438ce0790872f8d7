"""Supervised fine-tuning rows in TRL's ``SFTTrainer`` formats, as ``{"prompt", "completion"}`` (the completion a
string, trained; the prompt never):

* prompt-completion (TRL's): ``prompt`` a string or a conversation, ``completion`` a string or the assistant's
  messages;
* conversational (TRL's ``messages``): a conversation ending with the assistant's turn -- that turn is the
  completion, the turns before it the prompt (TRL's ``assistant_only_loss`` on the last turn);
* GSM8K's ``question`` / ``answer``: the question as a user turn, the worked answer as the completion (a
  ``prompt`` with an ``answer``, the embedded task's rows, likewise).

A row that is none of them is refused naming the row and its columns (``UserError``), before any model loads.
"""

from __future__ import annotations

from typing import Any

from unialign.errors import UserError
from unialign.text.data import ROLES, is_messages
from unialign.text.preference import completion_text


def sft_rows(rows: list[dict[str, Any]], source: str = "dataset") -> list[dict[str, Any]]:
    """``rows`` -> ``{"prompt", "completion", <other columns>}`` (module docstring)."""
    if not rows:
        raise UserError(f"{source}: no rows")
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        if "messages" in row:
            messages = row["messages"]
            if not is_messages(messages) or any(m["role"] not in ROLES for m in messages):
                raise UserError(f"{where}: field 'messages' must be a conversation (a non-empty list of "
                                f"{{'role', 'content'}} messages, roles {', '.join(ROLES)})")
            if messages[-1]["role"] != "assistant" or len(messages) < 2:
                raise UserError(f"{where}: field 'messages' must end with the assistant's turn after at least "
                                f"one other (the turn that is trained)")
            prompt, completion = messages[:-1], messages[-1]["content"]
        elif "prompt" in row and "completion" in row:
            prompt, completion = row["prompt"], completion_text(row["completion"])
        elif "question" in row and "answer" in row:
            prompt, completion = [{"role": "user", "content": row["question"]}], row["answer"]
        elif "prompt" in row and "answer" in row:  # a prompt with GSM8K's worked answer (the embedded task's rows)
            prompt, completion = row["prompt"], row["answer"]
        else:
            raise UserError(f"{where}: an SFT row needs 'prompt' and 'completion' (TRL's prompt-completion), "
                            f"'messages' (a conversation ending with the assistant's turn) or GSM8K's 'question' (or "
                            f"'prompt') / 'answer'; columns: {sorted(row)}")
        if not isinstance(completion, str) or not completion.strip():
            raise UserError(f"{where}: the completion must be non-empty text, got {completion!r:.60}")
        if not (isinstance(prompt, str) and prompt.strip()) and not is_messages(prompt):
            raise UserError(f"{where}: the prompt must be non-empty text or a conversation")
        rest = {k: v for k, v in row.items() if k not in ("messages", "prompt", "completion", "question", "answer")}
        out.append({"prompt": prompt, "completion": completion, **rest})
    return out
