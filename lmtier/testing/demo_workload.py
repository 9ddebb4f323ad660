"""The demo's workload (``scripts/demo.py``): token-exact chat prompts with long shared prefixes,
built with the model's own tokenizer and chat template from the fixed texts of
:mod:`lmtier.testing.server` (stdlib docstrings, license texts) — the same token ids in every phase.

Scenarios (sizes of :data:`FULL` / :data:`QUICK`): ``system`` (a long system prompt + short
questions), ``multiturn`` (a conversation growing turn by turn, canned assistant replies), ``rag``
(a few license documents + a question). Needs ``transformers`` (imported by :class:`Builder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmtier.testing.server import read_license, stdlib_docs

__all__ = ["FULL", "QUICK", "Builder", "Req", "Sizes", "build_workload"]


@dataclass
class Req:
    scenario: str
    name: str
    prompt_ids: list[int]


@dataclass
class Sizes:
    system_tokens: int
    questions: int
    turns: int
    turn_tokens: int
    docs: int
    doc_tokens: int
    rag_questions: int


FULL = Sizes(system_tokens=1500, questions=4, turns=5, turn_tokens=400, docs=3, doc_tokens=700, rag_questions=3)
QUICK = Sizes(system_tokens=600, questions=2, turns=3, turn_tokens=250, docs=2, doc_tokens=350, rag_questions=2)


class Builder:
    """Turns text into token-exact prompts with the model's own tokenizer and chat template."""

    def __init__(self, model: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model))

    def clip(self, text: str, n_tokens: int) -> str:
        ids = self.tok.encode(text, add_special_tokens=False)[:n_tokens]
        return self.tok.decode(ids).strip()

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def build_workload(model: Path, sizes: Sizes) -> list[Req]:
    b = Builder(model)
    docs = stdlib_docs()
    reqs: list[Req] = []

    # (i) long system prompt + short questions
    reference = b.clip("\n\n".join(docs[:60]), sizes.system_tokens)
    system = (
        "You are a careful assistant for Python programmers. Answer in one short sentence, using only "
        "the reference material below.\n\nREFERENCE MATERIAL\n" + reference
    )
    questions = [
        "What does textwrap.dedent do?",
        "How do I load JSON from a file object?",
        "What is collections.OrderedDict good for today?",
        "When should I use functools.lru_cache?",
        "What does itertools.chain do?",
        "What does heapq.heappush do?",
    ][: sizes.questions]
    for i, q in enumerate(questions):
        ids = b.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": q}])
        reqs.append(Req("system", f"q{i}", ids))

    # (ii) multi-turn conversation: turn k = all previous turns + a new user message
    messages = [
        {"role": "system", "content": "You are a concise assistant that explains Python library documentation."}
    ]
    pool = docs[60:]
    for t in range(sizes.turns):
        chunk = b.clip("\n\n".join(pool[t * 6 : t * 6 + 6]), sizes.turn_tokens)
        messages.append({"role": "user", "content": f"Here is more documentation:\n{chunk}\n\nSummarize it briefly."})
        reqs.append(Req("multiturn", f"turn{t}", b.chat_ids(messages)))
        # a canned (deterministic) assistant reply, so every phase sends the same conversation
        first_line = chunk.splitlines()[0] if chunk else "documentation"
        messages.append(
            {"role": "assistant", "content": f"This part documents {first_line[:120]} and related helpers."}
        )

    # (iii) RAG: a few documents + a question
    names = ["GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3"][: sizes.docs]
    doc_texts = [f"[Document {i + 1}: {n}]\n{b.clip(read_license(n), sizes.doc_tokens)}" for i, n in enumerate(names)]
    rag_questions = [
        "Which of these documents allow distributing modified versions, and under what condition?",
        "Summarize the patent clauses of these documents.",
        "Which document is the shortest to comply with?",
        "Do any of these documents require keeping copyright notices?",
    ][: sizes.rag_questions]
    for i, q in enumerate(rag_questions):
        content = "Use the documents to answer.\n\n" + "\n\n".join(doc_texts) + f"\n\nQuestion: {q}"
        ids = b.chat_ids(
            [
                {"role": "system", "content": "You answer questions about software licenses."},
                {"role": "user", "content": content},
            ]
        )
        reqs.append(Req("rag", f"q{i}", ids))
    return reqs
