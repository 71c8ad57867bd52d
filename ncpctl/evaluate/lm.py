"""``NCPLM``: our model as an lm-evaluation-harness model, registered as ``ncpctl``.

Scoring (``loglikelihood``, ``loglikelihood_rolling``) runs full forwards on right-padded
batches sorted by length: right padding never reaches a real position (every stack is
causal and a concept block containing padding only feeds positions at or after its own
last slot, which is padding), so a ConceptLM sees exactly what a lone full forward sees; a
model whose objective is not causal (``Objective.causal``) is scored one request at a time.
Which input a request is scored on, and at which positions, is the objective's
(``Objective.score``).
Only the positions being scored go through the LM head (the rest of a sequence needs
just its hidden states); requests with the same input (e.g. one-token answers to one
question) share a forward, each scored on its own continuation. Generation
(``generate_until``) is the objective's (``ncpctl.inference``; next-token: the incremental decoder).

Scores are normalised over the tokenizer's vocabulary (``cfg.vocab_size``), not the padded
rows of the embedding, which no text can produce.

Log-likelihoods are also accumulated per task (``token_stats``: NLL and scored tokens) so ``ncpctl eval`` can report token-weighted perplexities across perplexity sets.

An objective whose log-likelihoods are bounds (``Objective.bound``: the Causal Diffusion LM) answers
both request kinds with its Monte Carlo estimator instead (``Objective.loglikelihood_bounds``;
diffusion_elbo.py), LLaDA-style: the input is context + continuation left-truncated to
``max_length``, the continuation's tokens are noised and scored, the context stays clean; the
log-likelihood is minus the mean of ``diffusion_samples`` estimates of the bound (a lower bound on
the log-likelihood in expectation), keyed by ``diffusion_seed``, and ``token_stats`` also sums the
estimates' Monte Carlo variance (``mc_var``). ``is_greedy`` is the one-shot check
(``one_shot_greedy``: every continuation token the argmax with its block's continuation masked).

Answers go through a request cache where ``ncpctl eval`` gives one (``ncpctl.evaluate.cache``:
resumable, keyed by the checkpoint and the request); ``model_requests`` counts the requests the
model itself answered. Under a launcher (``ranks``; ``ncpctl.evaluate.parallel``) each rank answers
lm-eval's share of the documents and the token statistics are summed over the ranks
(``gather_stats``); a request a rank repeats to even out the batches is counted once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ncpctl.checkpoint import load_model
from ncpctl.errors import UserError
from ncpctl.evaluate import cache as request_cache
from ncpctl.evaluate.parallel import Collectives, Ranks, sum_stats
from ncpctl.inference import SamplingParams, eod_token, generate

DIFFUSION_SAMPLES = 8  # Monte Carlo samples per request of a bound's estimate (ncpctl eval --diffusion-samples)


def _batch_size(value: int | str) -> int:
    """lm-eval hands over ints or strings ("8", "auto", "auto:4"). ``auto`` does not probe
    memory here (scoring batches are right-padded full forwards, sized by the caller): 8."""
    s = str(value).strip()
    if s.isdigit() and int(s) > 0:
        return int(s)
    if s == "auto" or s.startswith("auto:"):
        logging.getLogger(__name__).info("batch_size=%s is taken as 8 (no automatic batch size search)", s)
        return 8
    raise UserError(f"batch_size={value!r}: expected a positive integer or auto")


@register_model("ncpctl")
class NCPLM(Collectives, TemplateLM):
    """``lm_eval`` model args: ``checkpoint=DIR`` (checkpoint or run dir), ``batch_size``,
    ``max_length`` (default the model's ``max_seq_len``), ``dtype`` (float32|bfloat16),
    ``device`` (cpu|cuda...), ``data=DIR`` (offline tasks' data, else found from the checkpoint),
    ``diffusion_samples`` / ``diffusion_seed``: the Monte Carlo samples and key of a bound's estimates
    (an objective whose log-likelihoods are bounds: the CDLM's ELBO); ``noised_context``: also the
    CDLM's noised-context estimate of each request (training's conditions: every block noised),
    summed per task in ``token_stats`` (``nll_noised``, ``mc_var_noised``). In-process: ``loaded`` (a
    ``LoadedModel``) instead of a checkpoint; ``live=True``: its model is a training run's module, used
    on its device and in its dtype as it is (``ncpctl.train.downstream``); ``cache``: a
    ``RequestCache``; ``ranks``: this process's place in a data-parallel evaluation."""

    def __init__(self, checkpoint: str | None = None, *, loaded=None, batch_size: int | str = 8,
                 max_length: int | None = None, dtype: str = "float32", device: str | None = None,
                 max_gen_toks: int = 256, diffusion_samples: int | str = DIFFUSION_SAMPLES,
                 diffusion_seed: int | str = 0, live: bool = False, cache: Any = None, ranks: Ranks | None = None,
                 noised_context: bool | str = False, **_: Any):
        super().__init__()
        self._rank, self._world_size = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
        self.cache, self.model_requests, self.requests = cache, 0, 0  # answered by the model / asked in all
        self._dtype = dtype
        if not str(diffusion_samples).isdigit() or int(diffusion_samples) < 1:
            raise UserError(f"diffusion_samples={diffusion_samples!r}: expected a positive integer")
        self.diffusion_samples, self.diffusion_seed = int(diffusion_samples), int(diffusion_seed)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise UserError(f"dtype={dtype!r}: expected float32, bfloat16 or float16")
        self._batch_size = _batch_size(batch_size)
        if loaded is None:
            if checkpoint is None:
                raise UserError("the ncpctl lm-eval model needs checkpoint=DIR")

            loaded = load_model(checkpoint)
        why = loaded.model.objective.refusal("eval")
        if why:
            raise UserError(f"{loaded.path}: {why}")
        self.noised_context = str(noised_context).lower() in ("1", "true", "yes")
        if self.noised_context and not hasattr(loaded.model.objective, "noised_estimates"):
            raise UserError(f"{loaded.path}: --noised-context applies to a Causal Diffusion LM (objective: "
                            f"{loaded.config.objective} has no noised context)")
        if loaded.tokenizer is None:
            raise UserError(f"{loaded.path}: no tokenizer.json in the checkpoint (needed for evaluation)")
        dev = torch.device(device or "cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():  # lm-eval's CLI defaults to cuda:0
            dev = torch.device("cpu")
        self.loaded = loaded
        # live: a training run's own module (ncpctl.train.downstream), scored where and as it trains (a
        # .to() would cast the weights being trained); the loop puts it back in train mode
        self.model = loaded.model.eval() if live else loaded.model.to(dev, dtype=getattr(torch, dtype)).eval()
        self.cfg = loaded.config
        self.tok = loaded.tokenizer
        self._device = dev
        self._max_length = int(max_length or self.cfg.max_seq_len)
        self._max_gen_toks = int(max_gen_toks)

        eot = eod_token(loaded)[1]
        self._eot = eot if eot is not None else 0
        self.token_stats: dict[str, dict[str, float]] = {}
        self._mc_var: list[float] = []  # the Monte Carlo variance of each result of the last scoring call
        self._noised: list[list[float]] = []  # [noised-context NLL, its variance] of each result, likewise

    @property
    def cache_settings(self) -> dict[str, Any]:
        """What, besides the request itself, changes an answer (part of every cache key)."""
        return {"max_length": self._max_length, "dtype": self._dtype, "max_gen_toks": self._max_gen_toks,
                "vocab": self.cfg.vocab_size, **({"diffusion_samples": self.diffusion_samples,
                                                  "diffusion_seed": self.diffusion_seed}
                                                 if self.model.objective.bound else {}),
                **({"noised_context": True} if self.noised_context else {})}

    def _answers(self, kind: str, requests, compute, cacheable=lambda r: True) -> list[Any]:
        """``compute``'s answers to ``requests``, through the request cache where there is one."""
        out, scored = request_cache.through(self.cache, kind, requests, self.cache_settings, compute,
                                            request_cache.CHUNK * self._batch_size, cacheable)
        self.model_requests += scored
        self.requests += len(requests)
        return out

    def gather_stats(self) -> None:
        """Sum ``token_stats`` and the request counts over the ranks of a data-parallel evaluation (a
        collective: every rank calls it); rank 0 then holds the totals."""
        if self._world_size > 1:
            parts = self.gather_object((self.token_stats, self.requests, self.model_requests))
            if self._rank == 0:
                self.token_stats = sum_stats([p[0] for p in parts])
                self.requests, self.model_requests = sum(p[1] for p in parts), sum(p[2] for p in parts)

    @property
    def likelihood(self) -> dict[str, Any]:
        """What the log-likelihoods are: exact, or a bound's Monte Carlo estimates (with how many samples)."""
        if not self.model.objective.bound:
            return {"kind": "exact"}
        return {"kind": "bound", "estimator": "ELBO (an upper bound on the NLL; Monte Carlo over the masks)",
                "samples": self.diffusion_samples, "seed": self.diffusion_seed,
                **({"noised_context": "every block noised (training's conditions): not a bound on the model as "
                                      "sampled"} if self.noised_context else {})}

    # ---- what lm-eval asks of a model ----

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.path / "tokenizer.json")

    def get_model_info(self) -> dict[str, Any]:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self.model.embed.weight.dtype), "model_name": str(self.loaded.path)}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=False)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) per request (through the cache); the per-task
        token statistics count each request once."""
        answers = self._answers("loglikelihood", requests, self._loglikelihood_answers)
        self._account(requests, [(a[0], a[2], a[3], *a[4:6]) for a in answers])
        return [(float(a[0]), bool(a[1])) for a in answers]

    def _loglikelihood_answers(self, requests) -> list[list[Any]]:
        """[ll, greedy, continuation tokens, Monte Carlo variance (, noised-context NLL and its variance)]
        per request. TemplateLM's
        encoding (trailing context spaces move to the continuation; empty context -> the EOT
        token), with all strings tokenized in one parallel batch."""
        strings: list[str] = []
        pairs = []
        for req in requests:
            ctx, cont = req.args
            if ctx == "":
                pairs.append(("", cont, len(strings)))
                strings.append(cont)
                continue
            n = len(ctx) - len(ctx.rstrip())
            if n:
                ctx, cont = ctx[:-n], ctx[-n:] + cont
            pairs.append((ctx, cont, len(strings)))
            strings += [ctx + cont, ctx]
        enc = [e.ids for e in self.tok.encode_batch(strings, add_special_tokens=False)] if strings else []
        new = []
        for req, (ctx, cont, i) in zip(requests, pairs):
            if ctx == "":
                c = enc[i]
                ctx_enc, cont_enc = ([self._eot], c) if c[:1] != [self._eot] else (c[:1], c[1:])
            else:
                whole, ctx_enc = enc[i], enc[i + 1]
                cont_enc = whole[len(ctx_enc):]
            new.append((req.args, ctx_enc, cont_enc))
        out = self._loglikelihood_tokens(new)
        var = self._mc_var or [0.0] * len(out)
        noised = self._noised or [[]] * len(out)
        return [[ll, g, len(cont), v, *z] for (ll, g), (_, _, cont), v, z in zip(out, new, var, noised)]

    def _account(self, requests, answers: list[tuple]) -> None:
        """Per-task NLL and token counts (for token-weighted perplexities across sets); a bound's
        estimates also their Monte Carlo variance. ``answers``: (ll, tokens, variance) per request, with
        the noised-context NLL and its variance after them under ``noised_context``. A
        request object seen twice (a data-parallel rank repeats its last request to even out the
        batches) is counted once."""
        seen: set[int] = set()
        for req, (ll, n_tokens, mc_var, *noised) in zip(requests, answers):
            if id(req) in seen:
                continue
            seen.add(id(req))
            st = self.token_stats.setdefault(getattr(req, "task_name", None) or "?", {"nll": 0.0, "tokens": 0})
            st["nll"] -= ll
            st["tokens"] += n_tokens
            if self.model.objective.bound:
                st["mc_var"] = st.get("mc_var", 0.0) + mc_var
            if noised:
                st["nll_noised"] = st.get("nll_noised", 0.0) + noised[0]
                st["mc_var_noised"] = st.get("mc_var_noised", 0.0) + noised[1]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        answers = self._answers("loglikelihood_rolling", requests, self._rolling_answers)
        self._account(requests, [tuple(a) for a in answers])
        return [float(a[0]) for a in answers]

    def _rolling_answers(self, requests) -> list[list[Any]]:
        """[ll, tokens, Monte Carlo variance (, noised-context NLL, its variance)] of each whole string,
        scored in lm-eval's disjoint rolling windows of ``max_length``."""
        from lm_eval import utils

        windows, owner = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for ctx, cont in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(r)
        scores = self._loglikelihood_tokens(windows, greedy=False)
        var = self._mc_var or [0.0] * len(scores)
        noised = self._noised or [[]] * len(scores)
        out = [[0.0, 0, 0.0] + ([0.0, 0.0] if self._noised else []) for _ in requests]
        for r, (ll, _), (_, _, cont), v, z in zip(owner, scores, windows, var, noised):
            out[r][0] += ll
            out[r][1] += len(cont)
            out[r][2] += v
            for i, x in enumerate(z):
                out[r][3 + i] += x
        return out

    @torch.no_grad()
    def _bound_tokens(self, requests, greedy: bool) -> list[tuple[float, bool]]:
        """requests: (key, context ids, continuation ids) -> (-(mean estimate of the bound), greedy?),
        one request at a time (its Monte Carlo samples are the rows of the estimator's forwards);
        identical requests are scored once. Sets ``_mc_var``: each result's Monte Carlo variance."""
        L, dev = self.max_length, self._device
        done: dict[tuple[tuple[int, ...], int], tuple[float, bool, float, list]] = {}
        out, self._mc_var, self._noised = [], [], []
        for _, ctx, cont in requests:
            inp = tuple((list(ctx) + list(cont))[-L:])  # a continuation longer than the window: its last tokens
            n = min(len(cont), len(inp))
            if (inp, n) not in done:
                x = torch.tensor([inp], device=dev)
                scored = torch.zeros_like(x, dtype=torch.bool)
                scored[:, len(inp) - n:] = True
                est, hit = self.model.objective.loglikelihood_bounds(
                    self.model, x, scored, samples=self.diffusion_samples, seed=self.diffusion_seed, greedy=greedy)
                S = est.shape[1]
                var = float(est[0].var()) / S if S > 1 else float("nan")
                nz = []
                if self.noised_context:  # beside the bound, the same samples: training's conditions
                    e = self.model.objective.noised_estimates(self.model, x, scored, samples=S, seed=self.diffusion_seed)
                    nz = [float(e[0].mean()), float(e[0].var()) / S if S > 1 else float("nan")]
                done[(inp, n)] = (-float(est[0].mean()), bool(hit[0]) if hit is not None else False, var, nz)
            ll, g, var, nz = done[(inp, n)]
            out.append((ll, g))
            self._mc_var.append(var)
            if nz:
                self._noised.append(nz)
        return out

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, greedy: bool = True,
                              **_) -> list[tuple[float, bool]]:
        """requests: (key, context ids, continuation ids) -> (sum log p(cont), greedy?).

        The model's objective says which input a request is scored on and which positions'
        logits score its continuation (``Objective.score``; next-token: context + continuation
        minus its last token, left-truncated to ``max_length`` like HFLM). Requests with the
        same input share one forward but are each scored on their own continuation: one-token
        answers to the same question have equal inputs and differ only in the target.
        Identical requests are scored once. An objective whose log-likelihoods are bounds:
        ``_bound_tokens`` (``greedy``: also whether each continuation is the greedy pick)."""
        if self.model.objective.bound:
            return self._bound_tokens(requests, greedy)
        self._mc_var = []
        L, V = self.max_length, self.cfg.vocab_size
        score = self.model.objective.score
        inputs: dict[tuple[int, ...], int] = {}  # input ids -> forward index
        scored: dict[tuple[int, tuple[int, ...]], int] = {}  # (forward, continuation) -> score index
        per_input: list[list[int]] = []  # forward index -> its score indices
        conts: list[tuple[int, ...]] = []
        where: list[tuple[int, ...]] = []  # score index -> the positions scoring its tokens
        which = []
        for _, ctx, cont in requests:
            inp, cont, at = score(ctx, cont, L)
            f = inputs.setdefault(inp, len(inputs))
            if f == len(per_input):
                per_input.append([])
            key = (f, cont)
            if key not in scored:
                scored[key] = len(conts)
                conts.append(cont)
                where.append(at)
                per_input[f].append(scored[key])
            which.append(scored[key])
        input_ids = list(inputs)  # in forward-index order
        order = sorted(range(len(input_ids)), key=lambda i: -len(input_ids[i]))
        results: list[tuple[float, bool] | None] = [None] * len(conts)
        dev = self._device
        bs = self._batch_size if self.model.objective.causal else 1  # right padding would be seen
        head = self.model.head
        for s in range(0, len(order), bs):
            idx = order[s : s + bs]
            T = len(input_ids[idx[0]])
            # right padding only: every row starts at position 0, so concept blocks are
            # aligned as in a lone full forward and padding never feeds a scored position
            x = torch.zeros(len(idx), T, dtype=torch.long)
            rows, cols, targets, spans = [], [], [], []
            for r, f in enumerate(idx):
                inp = input_ids[f]
                x[r, : len(inp)] = torch.tensor(inp)
                for j in per_input[f]:
                    n = len(conts[j])
                    rows += [r] * n
                    cols += where[j]
                    targets += conts[j]
                    spans.append((j, n))
            # final-norm hidden states (B, T, d): the LM head runs only on the scored rows
            h = self.model(x.to(dev), return_hidden=True, compute_logits=False).hidden
            sel = h[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]  # (N, d)
            logp = head(sel)[:, :V].float().log_softmax(-1)  # (N, V)
            tgt = torch.tensor(targets, device=dev)
            tok_lp = logp.gather(1, tgt[:, None])[:, 0].cpu()
            greedy = (logp.argmax(-1) == tgt).cpu()
            at = 0
            for j, n in spans:
                results[j] = (float(tok_lp[at : at + n].sum()), bool(greedy[at : at + n].all()))
                at += n
        return [results[w] for w in which]  # type: ignore[misc]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's generation (greedy ones through the cache; a sampled one is drawn anew,
        every repeat of it too). As lm-eval's Hugging Face model, a temperature samples only with
        ``do_sample``."""
        return self._answers("generate_until", requests, self._generate,
                             cacheable=lambda r: not (r.args[1] or {}).get("do_sample", False))

    def _generate(self, requests) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for key, members in groups.items():
            kw = dict(json.loads(key))
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eot_text = self.tok_decode([self._eot])
            if eot_text not in until:
                until.append(eot_text)
            sample = bool(kw.pop("do_sample", False))
            temp = float(kw.pop("temperature", 1.0 if sample else 0.0))
            params = SamplingParams(
                max_new_tokens=int(kw.pop("max_gen_toks", self._max_gen_toks)), temperature=temp,
                greedy=not sample or temp == 0.0, top_k=kw.pop("top_k", None), top_p=kw.pop("top_p", None),
                seed=kw.pop("seed", None), stop=until,
            )
            enc = [self.tok_encode(requests[i].args[0]) or [self._eot] for i in members]
            order = sorted(range(len(members)), key=lambda j: -len(enc[j]))
            for s in range(0, len(order), self._batch_size):
                part = order[s : s + self._batch_size]
                done = generate(self.model, [enc[j] for j in part], params, self.tok_decode, eod_id=self._eot,
                                vocab_size=self.cfg.vocab_size, max_len=self.max_length)
                for j, c in zip(part, done):
                    out[members[j]] = c.text
        return out  # type: ignore[return-value]
