"""NCP / ConceptLM causal LM for HF transformers (``trust_remote_code=True``).

Written by ``ncpctl export`` next to a copy of ncpctl's model package, flattened into one folder
(``core/model.py`` -> ``core_model.py``, ``from ncpctl.model.core.layers import`` -> ``from
.core_layers import``: transformers resolves only flat relative imports; the same modeling code
ncpctl trains, not a second implementation). This file only adapts it to transformers: the HF config, the
``attention_mask`` convention, ``generate``'s cache protocol and the output type. It needs
torch and transformers; nothing here or in the copied modules imports ncpctl.

Padding: concept segments are anchored at each row's first real token, so an
``attention_mask`` may pad on the left (batched ``generate``): row b's real tokens then get
positions 0, 1, ... and padding keys are masked out, so every row computes what it would
alone. Right padding is allowed without a cache (causal attention keeps it out of the real
positions); padding inside a row is rejected.

Incremental decoding: with ``use_cache`` the forward returns an ``NCPCache`` as ``cache`` and
each later forward feeds one new token per row (ncpctl's ``decode.py``: token-layer,
concept-layer and segmentation state per row). ``generate`` only carries that object from one
forward to the next (``_supports_default_dynamic_cache`` is False, as for recurrent models:
the concept path's state is not per-layer keys/values that a transformers ``Cache`` could
hold). Without a cache every forward recomputes the whole sequence.

A Causal Diffusion LM (``objective: causal_diffusion``) exports through this adapter too: the
forward is the model's, with its block-causal attention (a position sees its whole block), so
its logits are ncpctl's; ``labels`` are aligned with ``input_ids`` (the original tokens at the
[MASK] positions, -100 elsewhere: no shift). Its ``generate`` is block-wise sampling, ncpctl's own
sampler (``designs/causal_diffusion/sampler.py``, shipped with the model package): ``model.generate(input_ids,
attention_mask=..., max_new_tokens=..., do_sample=..., temperature=..., top_k=..., top_p=...)`` plus
``steps_per_block``, ``commit_per_step`` and ``seed`` (row b samples with seed + b), left padding
allowed, each row ending at the end of the block where it produced ``eos_token_id`` (the tokens after
it are ``pad_token_id``), returning the prompts followed by the new tokens as transformers does.
``config.mask_token_id`` and the tokenizer's ``mask_token`` name the [MASK] token. An incremental
cache is refused, and so is right padding (a padded slot would sit inside a real token's block).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.model import NCPModel
from ncpctl.model.designs.causal_diffusion.sampler import sample_blocks

from .configuration_ncp import NCPConfig


class NCPCache:
    """Incremental-decoding state of a batch: ncpctl's ``DecodeState`` (``state``)."""

    # generate's deferred stop check (mps) asks whether it may roll the cache back: it may not
    is_croppable = False

    def __init__(self, state):
        self.state = state

    def reorder_cache(self, beam_idx):
        """Keep rows ``beam_idx`` (B,) in that order (generate's beam search, after each step)."""
        self.state.reorder(beam_idx)


def left_padding(attention_mask, allow_right: bool, why: str = "with a cache, pad on the left (new tokens follow "
                 "the last slot)") -> list:
    """Leading padding slots per row (host ints) of a (B, T) 0/1 mask whose ones must be
    contiguous; trailing zeros (right padding) only where ``allow_right`` (else ``why``)."""
    am = attention_mask.bool()
    T = am.shape[1]
    idx = torch.arange(T, device=am.device)
    first = torch.where(am, idx, T).amin(1)  # (B,) first real slot
    last = torch.where(am, idx, -1).amax(1)  # (B,) last real slot
    rows = torch.stack((first, last, am.sum(1))).t().tolist()
    for f, l, n in rows:
        if n == 0 or l - f + 1 != n:
            raise ValueError("attention_mask: every row needs real tokens, with padding only on the left "
                             "(or, without a cache, on the right), never inside")
        if l != T - 1 and not allow_right:
            raise ValueError(f"attention_mask: {why}")
    return [f for f, _, _ in rows]


class NCPForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NCPConfig
    base_model_prefix = "ncp"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    # generate refuses assisted decoding for stateful models; it would need to roll NCPCache back
    _is_stateful = True

    def __init__(self, config: NCPConfig):
        super().__init__(config)
        core = NCPModel(ModelConfig.from_dict(config.ncp))
        # ncpctl's modules become ours (embed, encoder, concept, decoder, final_norm, lm_head):
        # the weights keep ncpctl's names, and ``core`` computes with these very modules
        for name, child in core.named_children():
            self.add_module(name, child)
        self.__dict__["core"] = core  # not a submodule: its children are already ours
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"lm_head.weight": "embed.weight"}
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = self.core.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = self.core.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # generate must not build a DynamicCache: the forward creates and returns its NCPCache
        return False

    def forward(self, input_ids=None, attention_mask=None, labels=None, cache=None, use_cache=None, **kwargs):
        """input_ids (B, T) -> logits (B, T, V). With ``cache`` (an NCPCache) T must be 1: one new
        token per row, the cache advances (``attention_mask`` is then not read: the padding is
        the prefill's). With ``use_cache`` (and no cache) the prompt is prefilled and the new
        NCPCache returned as ``cache``."""
        causal = self.core.objective.causal
        if use_cache and not causal:
            raise ValueError(f"objective {self.core.cfg.objective}: no incremental decoding (use_cache); "
                             "its block-wise sampling is `ncpctl generate`")
        if cache is not None:
            if input_ids.shape[1] != 1:
                raise ValueError(f"with a cache, feed one new token per row, got {input_ids.shape[1]}")
            logits = self.core.decode_step(cache.state, input_ids[:, 0])[:, None]  # (B, 1, V)
        else:
            B, T = input_ids.shape
            pad = [0] * B
            if attention_mask is not None and not bool(attention_mask.all()):
                why = {} if causal else {"why": "pad on the left: a right-padded slot would sit inside a real "
                                                "token's block"}
                pad = left_padding(attention_mask, allow_right=causal and not use_cache, **why)
            if any(pad) and not causal:  # row by row: each row's blocks follow its own positions (padding: 0)
                logits = None
                for b, p in enumerate(pad):
                    row = self.core(input_ids[b : b + 1, p:]).logits  # (1, T - p, V)
                    logits = row.new_zeros(B, T, row.shape[-1]) if logits is None else logits
                    logits[b, p:] = row[0]
            elif use_cache or any(pad):
                logits, state = self.core.prefill(input_ids, [T - p for p in pad])
                cache = NCPCache(state)
            else:
                logits = self.core(input_ids).logits
        loss = None
        if labels is not None:  # next-token: HF's internal shift; otherwise labels aligned with the inputs
            s = 1 if causal else 0
            loss = F.cross_entropy(logits[:, : logits.shape[1] - s].float().flatten(0, 1), labels[:, s:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    def generate(self, *args, **kwargs):
        if not self.core.objective.causal:  # transformers would sample it one token at a time: block by block instead
            return self._generate_blocks(*args, **kwargs)
        return super().generate(*args, **kwargs)

    @torch.no_grad()
    def _generate_blocks(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
        """A block-sampling objective's ``generate`` (the module docstring): (B, T + max_new_tokens)."""
        own = {k: kwargs.pop(k) for k in ("steps_per_block", "commit_per_step", "seed") if k in kwargs}
        gc = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unused = gc.update(**kwargs)
        if unused:
            raise ValueError(f"generate of a block-sampling model does not take {sorted(unused)}")
        n = gc.max_new_tokens if gc.max_new_tokens is not None else 64
        B, T = input_ids.shape
        pad = [0] * B
        if attention_mask is not None and not bool(attention_mask.all()):
            pad = left_padding(attention_mask, allow_right=False, why="pad on the left: a right-padded slot would "
                               "sit inside a real token's block")
        prompts = [input_ids[b, p:].tolist() for b, p in enumerate(pad)]
        if T - min(pad) + n > self.core.cfg.max_seq_len:
            raise ValueError(f"a prompt of {T - min(pad)} tokens and {n} new tokens pass max_seq_len="
                             f"{self.core.cfg.max_seq_len}")
        greedy = not gc.do_sample or gc.temperature == 0  # temperature None: transformers' default, 1
        params = SimpleNamespace(max_new_tokens=n, temperature=gc.temperature or 1.0, top_k=gc.top_k, top_p=gc.top_p,
                                 is_greedy=greedy, steps_per_block=own.get("steps_per_block"),
                                 commit_per_step=own.get("commit_per_step"), seed=own.get("seed"))
        eos = gc.eos_token_id
        eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
        new = sample_blocks(self.core, prompts, params, vocab_size=self.core.cfg.vocab_size,
                            on_block=lambda blk: [any(t in eos for t in toks) for toks in blk])
        fill = gc.pad_token_id if gc.pad_token_id is not None else (min(eos) if eos else 0)
        out = torch.full((B, T + n), fill, dtype=input_ids.dtype, device=input_ids.device)
        out[:, :T] = input_ids
        for b, toks in enumerate(new):
            end = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))  # up to and with the first EOS
            out[b, T : T + end] = torch.tensor(toks[:end], dtype=input_ids.dtype)
        return out
