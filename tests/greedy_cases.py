"""The greedy test cases several test modules share: three passages, four questions over them, the chat prompt
and `model.generate`'s greedy reference (the fixtures that use them live in conftest.py)."""

from __future__ import annotations

import torch

PASSAGES = [
    "The Danube is Europe's second-longest river. It rises in the Black Forest in Germany and flows "
    "southeast for 2,850 km through ten countries before emptying into the Black Sea.",
    "Photosynthesis converts light energy into chemical energy. In plants it takes place in chloroplasts, "
    "which contain chlorophyll, and it releases oxygen as a by-product.",
    "Python's open() function returns a file object. Mode 'a' opens a file for appending: every write goes "
    "to the end of the file, whatever the current seek position is.",
]
QUESTIONS = [
    ("Repeat the first sentence of the passage exactly.", 0),
    ("Where does the Danube rise and where does it end? Quote the passage.", 0),
    ("Summarize the passage in two sentences, copying its wording.", 1),
    ("What does mode 'a' do? Answer with a quote from the passage.", 2),
]


def chat_prompt(tokenizer, passage: str, question: str) -> list[int]:
    messages = [{"role": "user", "content": f"Passage:\n{passage}\n\nQuestion: {question}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def reference(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """Plain greedy decoding of `model`, its prompt read as the backends read it (`generate_kwargs`: in their
    chunks; by prompt forwards, for a model that reads prompts by role)."""
    from ragspec.decoding.backends.transformers import generate_kwargs

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                             pad_token_id=eos[0], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             **generate_kwargs(model, prompt))
    return out[0, len(prompt):].tolist()
