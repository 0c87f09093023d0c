"""Multi-turn episodes on the SGLang backend, token in / token out (docs/agents.md).

`episode.py` drives episodes: the `ep` object an episode function gets (`await ep.generate()`,
`ep.append(...)`, `ep.add_reward(x)`, `ep.storage`) and `EpisodeRunner`, which runs G episodes per prompt
against the SGLang servers (one /generate request per model turn, on the exact ids so far) and turns each
into one Sample: every token after the prompt, a per-token loss mask (1 = the model's), the turns and their
rewards. `chat.py` renders chat messages (tool results, user turns) through the tokenizer's template as the
tokens to append. `tools.py` holds the tools: schemas, the Qwen3 call parser, the sandboxed worker pool
they run in, and the built-in tool episode.
"""
