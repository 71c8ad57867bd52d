"""Recipe loading: precedence, extends, and every kind of error reported at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe, parse_set

BASE = """\
run: {dir: RUN}
data: {sources: [builtin:python-stdlib]}
tokenizer: {vocab_size: 512}
model: {size: debug, concept: {enabled: true}}
train: {max_steps: 10, micro_batch_size: 2, seq_len: 64}
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    p = tmp_path / "base.yaml"
    p.write_text(BASE.replace("RUN", str(tmp_path / "run")))
    return p


def errors_of(path: Path, sets: list[str] = (), **kw) -> list[str]:
    with pytest.raises(UserError) as e:
        load_recipe(path, sets, **kw)
    return e.value.problems


def child(tmp_path: Path, text: str, name: str = "child.yaml") -> Path:
    p = tmp_path / name
    p.write_text("extends: base.yaml\n" + text)
    return p


def test_defaults_yaml_set_precedence(base: Path, tmp_path: Path) -> None:
    r = load_recipe(base)
    assert r.train.max_steps == 10  # YAML beats the default (100)
    assert r.train.lr == 6e-4  # default where the YAML is silent
    r = load_recipe(base, ["train.max_steps=7", "train.lr=1e-3", "train.max_steps=9"])
    assert r.train.max_steps == 9  # --set beats YAML; the last --set wins
    assert r.train.lr == 1e-3
    c = child(tmp_path, "train: {max_steps: 20}\n")
    r = load_recipe(c)
    assert r.train.max_steps == 20 and r.train.micro_batch_size == 2  # child over parent, rest inherited
    assert load_recipe(c, ["train.max_steps=3"]).train.max_steps == 3


def test_set_parses_yaml_values_and_nested_keys(base: Path) -> None:
    r = load_recipe(base, ["model.concept.k=2", "data.sources=[builtin:python-stdlib]", "train.betas=[0.8, 0.9]"])
    assert r.model_config.concept.k == 2
    assert r.train.betas == [0.8, 0.9]
    assert parse_set("a.b=hello world") == (["a", "b"], "hello world")
    assert parse_set("a=") == (["a"], "")
    for bad in ("noequals", "=3", "a..b=1"):
        with pytest.raises(UserError, match="KEY.PATH=VALUE"):
            parse_set(bad)


def test_derived_values(base: Path) -> None:
    r = load_recipe(base, ["train.global_batch_size=8"])
    assert (r.grad_accum_steps, r.global_batch_size) == (4, 8)
    r = load_recipe(base, ["train.global_batch_size=8"], world_size=2)
    assert r.grad_accum_steps == 2
    assert r.model_config.vocab_size == 512 and r.model_config.padded_vocab_size == 512
    assert r.seq_len == 64 and r.run_dir.name == "run"


def test_unknown_keys_name_file_and_suggest(base: Path, tmp_path: Path) -> None:
    c = child(tmp_path, "model: {d_modle: 3}\ntrian: {}\ntrain: {max_step: 3}\n")
    errs = errors_of(c)
    assert f"{c}: model.d_modle: unknown key (did you mean 'd_model'?)" in errs
    assert f"{c}: train.max_step: unknown key (did you mean 'max_steps'?)" in errs
    assert any(e.startswith(f"{c}: trian: unknown section (did you mean 'train'?)") for e in errs)
    assert len(errs) == 3


def test_an_unknown_section_named_only_by_set_is_blamed_on_the_set(base: Path) -> None:
    """Issue 28: ``--set trian.max_steps=3`` was reported as the recipe file's ``trian: unknown section``."""
    assert errors_of(base, ["trian.max_steps=3"]) == ["--set: trian: unknown section (did you mean 'train'?)"]
    assert errors_of(base, ["model.concpet.k=3"]) == ["--set: model.concpet: unknown key (did you mean 'concept'?)"]


def test_wrong_types(base: Path) -> None:
    errs = errors_of(base, ["train.max_steps=ten", "train.seed=true", "model.concept.enabled=3", "train.lr=fast"])
    assert "--set: train.max_steps: Input should be a valid integer, got 'ten'" in errs
    assert any(e.startswith("--set: train.seed: Input should be a valid integer") for e in errs)
    assert any(e.startswith("--set: model.concept.enabled:") for e in errs)
    assert any(e.startswith("--set: train.lr:") for e in errs)
    assert len(errs) == 4


def test_missing_files(base: Path, tmp_path: Path) -> None:
    errs = errors_of(base, ["tokenizer.path=/nonexistent/tokenizer.json", "data.train_prefix=/nonexistent/pile",
                            "train.resume=/nonexistent/ckpt", "data.sources=[/nonexistent/*.txt]"], need_sources=True)
    assert "--set: tokenizer.path: file not found: /nonexistent/tokenizer.json" in errs
    assert any(e.startswith("--set: data.train_prefix: /nonexistent/pile.bin and .idx not found") for e in errs)
    assert any(e.startswith("--set: train.resume: checkpoint not found") for e in errs)
    # train_prefix given: sources are not needed, so a missing source glob is not reported
    assert len(errs) == 3
    errs = errors_of(base, ["data.sources=[/nonexistent/*.txt]"], need_sources=True)
    assert errs == ["--set: data.sources[0].path: no file matches '/nonexistent/*.txt'"]
    c = child(tmp_path, "")
    c.write_text("extends: missing.yaml\n")
    assert errors_of(c) == [f"{c}: extends: missing.yaml: file not found"]
    assert errors_of(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: file not found"]


def test_impossible_combinations(base: Path) -> None:
    errs = errors_of(base, [
        "model.concept.segments=5",  # S does not divide d=64
        "train.global_batch_size=7", "train.grad_accum_steps=2",  # 7 != 2 x 2 x 1
        "tokenizer.vocab_size=70000", "data.dtype=uint16",  # vocab does not fit uint16
        "train.min_lr=1.0", "train.seq_len=512",  # min_lr > lr, seq_len > max_seq_len (256)
    ])
    assert "--set: model.concept.segments: 5 does not divide d_model=64" in errs
    assert any(e.startswith("--set: train.global_batch_size: 7 != micro_batch_size x grad_accum_steps x world size")
               for e in errs)
    assert any(e.startswith("--set: data.dtype: uint16 holds ids below 65536, but the tokenizer has 70000") for e in errs)
    assert any(e.startswith("--set: train.min_lr: 1.0 is above train.lr") for e in errs)
    assert any(e.startswith("--set: train.seq_len: 512 exceeds model.max_seq_len=256") for e in errs)
    assert len(errs) == 5
    errs = errors_of(base, ["model.vocab_size=100"])
    assert errs == ["--set: model.vocab_size: 100 is smaller than the tokenizer's 512 tokens"]
    errs = errors_of(base, ["train.global_batch_size=6"], world_size=4)
    assert errs == ["--set: train.global_batch_size: 6 is not divisible by micro_batch_size x world size = 2 x 4"]
    errs = errors_of(base, ["model.concept.encoder_layers=9", "model.concept.k=128"])
    assert any("model.concept.encoder_layers: must be between 0 and the 4 token layers" in e for e in errs)
    assert any("model.concept.k: 128 is longer than train.seq_len=64" in e for e in errs)


def test_all_problems_at_once(base: Path, tmp_path: Path) -> None:
    """One recipe with an unknown key, a wrong type, a missing file and an impossible
    combination: all four reported in one go."""
    c = child(tmp_path, "model: {concept: {segments: 3}, colour: red}\ntrain: {max_steps: 1.5}\n"
                        "tokenizer: {path: /no/such/tokenizer.json}\n")
    errs = errors_of(c)
    assert len(errs) == 4, errs
    assert all(e.startswith(f"{c}: ") for e in errs)
    keys = sorted(e.split(": ")[1] for e in errs)
    assert keys == ["model.colour", "model.concept.segments", "tokenizer.path", "train.max_steps"]


def test_error_names_the_file_that_set_the_key(base: Path, tmp_path: Path) -> None:
    base.write_text(base.read_text() + "deepspeed: {zero_stage: 5}\n")
    c = child(tmp_path, "train: {max_steps: 0}\n")
    errs = errors_of(c)
    assert any(e.startswith(f"{base.resolve()}: deepspeed.zero_stage:") or e.startswith(f"{base}: deepspeed.zero_stage:")
               for e in errs), errs
    assert any(e.startswith(f"{c}: train.max_steps:") for e in errs)


def test_invalid_yaml_and_non_mapping(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  max_steps: [1,\n")
    (err,) = errors_of(p)
    assert err.startswith(f"{p}:") and "invalid YAML" in err
    p.write_text("- a\n- b\n")
    assert errors_of(p) == [f"{p}: a recipe must be a mapping of sections, got list"]


def test_extends_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    errs = errors_of(tmp_path / "a.yaml")
    assert len(errs) == 1 and "extends: cycle" in errs[0]


def test_resolved_recipe_round_trips(base: Path, tmp_path: Path) -> None:
    r = load_recipe(base, ["train.max_steps=5", "model.concept.k=2"])
    out = r.write_resolved(tmp_path / "out")
    text = out.read_text()
    assert text.startswith("# Resolved by ncpctl") and "--set train.max_steps=5" in text
    again = load_recipe(out)
    assert again.to_dict() == r.to_dict()
    assert again.model_config == r.model_config
    assert yaml.safe_load(text)["model"]["concept"]["k"] == 2
    json.dumps(r.to_dict())  # JSON-serialisable, for --json output


# One test per error kind of issue #2, each from a recipe file (not --set): exactly one
# line, naming that file and the key path. A check that stops firing fails its own case.
ERROR_KINDS = {
    "unknown key": ("train: {max_stpes: 3}\n", "train.max_stpes: unknown key (did you mean 'max_steps'?)"),
    "wrong type": ("train: {seed: abc}\n", "train.seed: Input should be a valid integer, got 'abc'"),
    "missing tokenizer file": ("tokenizer: {path: /no/such/tokenizer.json}\n",
                               "tokenizer.path: file not found: /no/such/tokenizer.json"),
    "missing dataset prefix": ("data: {train_prefix: /no/such/pile}\n",
                               "data.train_prefix: /no/such/pile.bin and .idx not found (a Megatron dataset prefix)"),
    "missing source files": ("data: {sources: ['/no/such/*.txt']}\n",
                             "data.sources[0].path: no file matches '/no/such/*.txt'"),
    "S does not divide d": ("model: {concept: {segments: 5}}\n", "model.concept.segments: 5 does not divide d_model=64"),
    "global batch != micro x accum x world": (
        "train: {global_batch_size: 7, grad_accum_steps: 2}\n",
        "train.global_batch_size: 7 != micro_batch_size x grad_accum_steps x world size = 2 x 2 x 1 = 4"),
    "vocab larger than the token dtype": (
        "tokenizer: {vocab_size: 70000}\ndata: {dtype: uint16}\n",
        "data.dtype: uint16 holds ids below 65536, but the tokenizer has 70000 tokens; use int32 or auto"),
}


@pytest.mark.parametrize("kind", list(ERROR_KINDS))
def test_each_error_kind_alone(kind: str, base: Path, tmp_path: Path) -> None:
    text, message = ERROR_KINDS[kind]
    c = child(tmp_path, text)
    assert errors_of(c, need_sources=True) == [f"{c}: {message}"]


def test_every_error_kind_at_once(base: Path, tmp_path: Path) -> None:
    """All the kinds above in one recipe: every line reported in one go (the data ones merged)."""
    c = child(tmp_path, "train: {max_stpes: 3, seed: abc, global_batch_size: 7, grad_accum_steps: 2}\n"
                        "tokenizer: {vocab_size: 70000}\n"
                        "data: {dtype: uint16, sources: ['/no/such/*.txt']}\n"
                        "model: {concept: {segments: 5}}\n")
    errs = errors_of(c, need_sources=True)
    want = {ERROR_KINDS[k][1] for k in ("unknown key", "wrong type", "missing source files", "S does not divide d",
                                        "global batch != micro x accum x world",
                                        "vocab larger than the token dtype")}
    assert sorted(errs) == sorted(f"{c}: {m}" for m in want)


def test_no_follow_on_errors_from_dropped_keys(base: Path, tmp_path: Path) -> None:
    """A bad source entry is reported once; the cross-field check must not add 'no sources
    given' for the list that validation had to drop."""
    c = child(tmp_path, "data: {sources: [{path: builtin:python-stdlib, feild: text}]}\n")
    assert errors_of(c, need_sources=True) == [f"{c}: data.sources[0].feild: unknown key (did you mean 'field'?)"]


def test_stable_names(base: Path) -> None:
    """The recipe keys scripts rely on (issue #2) exist, take --set and land where documented."""
    r = load_recipe(base, ["run.dir=/tmp/somewhere", "data.sources=[builtin:python-stdlib]",
                           "tokenizer.vocab_size=1000", "train.max_steps=3", "train.seed=7",
                           "model.size=llama-debug", "model.concept.enabled=false"])
    assert r.run_dir == Path("/tmp/somewhere") and r.data_dir == Path("/tmp/somewhere/data")
    assert [s.path for s in r.data.sources] == ["builtin:python-stdlib"]
    assert r.tokenizer.vocab_size == 1000 == r.model_config.vocab_size
    assert (r.train.max_steps, r.train.seed) == (3, 7)
    assert r.model_config.name == "llama-debug" and r.model_config.concept.enabled is False
    assert load_recipe(base, ["model.concept.enabled=true"]).model_config.concept.enabled is True


def test_bad_table3_residual_keys_name_the_key(base: Path) -> None:
    """The keys of Table 3's two last arms (crc_mode, block_attnres): one error each, naming the key."""
    errs = errors_of(base, ["model.crc_mode=everywhere", "model.crc_connections=[encoder-decoder]"])
    assert len(errs) == 1 and errs[0].startswith("--set: model.crc_mode:"), errs
    errs = errors_of(base, ["model.residual=block_attnres", "model.attnres_block=0"])
    assert errs == ["--set: model.attnres_block: must be a positive integer, got 0"]
    errs = errors_of(base, ["model.residual=block_attnres", "model.crc_connections=[concept-decoder]"])
    assert len(errs) == 1 and errs[0].startswith("--set: model.crc_connections: residual: block_attnres has its own")


def test_non_finite_and_out_of_range_optimizer_values_are_refused(base: Path, tmp_path: Path) -> None:
    """Issue 21: `.inf` hyperparameters, betas outside [0, 1) and an absurd max_steps were accepted."""
    errs = errors_of(base, ["train.lr=.inf", "train.eps=.inf", "train.betas=[2,-1]", f"train.max_steps={10**23}",
                            "train.weight_decay=.nan", "train.grad_clip=-.inf", "model.init_std=.nan",
                            "train.seed=4294967296"])
    assert "--set: train.lr: Input should be a finite number, got inf" in errs
    assert "--set: train.eps: Input should be a finite number, got inf" in errs
    assert "--set: train.betas[0]: Input should be less than 1, got 2" in errs
    assert "--set: train.betas[1]: Input should be greater than or equal to 0, got -1" in errs
    assert f"--set: train.max_steps: Input should be less than or equal to {2**53}, got {10**23}" in errs
    assert "--set: train.weight_decay: Input should be a finite number, got nan" in errs
    assert "--set: train.grad_clip: Input should be a finite number, got -inf" in errs
    assert "--set: model.init_std: Input should be a finite number, got nan" in errs
    assert any(e.startswith("--set: train.seed: Input should be less than 4294967296") for e in errs)
    assert len(errs) == 9
    c = child(tmp_path, "train: {max_steps: 1e23, lr: .inf}\n")  # the same from a file, named by the file
    assert set(errors_of(c)) == {f"{c}: train.max_steps: Input should be a valid integer, got 1e+23",
                                 f"{c}: train.lr: Input should be a finite number, got inf"}
    assert load_recipe(base, ["train.betas=[0.0, 0.999]", "train.lr=0.01"]).train.betas == [0.0, 0.999]


def _bomb(levels: int) -> str:
    """Billion laughs: level i maps ten keys to level i-1, so `levels` lines name 10**(levels + 1) values."""
    lines = ["deepspeed:", "  extra:", "    l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels + 1):
        lines.append(f"    l{i}: &l{i} {{" + ", ".join(f"k{j}: *l{i - 1}" for j in range(10)) + "}")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_fast(base: Path, tmp_path: Path) -> None:
    import time

    c = child(tmp_path, _bomb(8))  # 10**9 values once expanded
    t0 = time.perf_counter()
    errs = errors_of(c)
    assert time.perf_counter() - t0 < 2.0
    assert errs == [f"{c}: YAML aliases expand it to more than 100,000 values (an alias bomb?); refusing to read it"]
    c.write_text("extends: base.yaml\ndeepspeed: {extra: &a {x: [1, *a]}}\n")  # an alias inside its own value
    assert errors_of(c) == [f"{c}: a YAML alias is used inside the value it names (a recursive structure); "
                            "refusing to read it"]
    bomb = "[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&a{i} [" + ", ".join(
        ["*a" if i == 0 else f"*a{i - 1}"] * 10) + "]" for i in range(8)]) + "]"
    with pytest.raises(UserError, match="--set: deepspeed.extra: YAML aliases expand it"):
        load_recipe(base, [f"deepspeed.extra={{bomb: {bomb}}}"])


def test_ordinary_yaml_aliases_still_work(base: Path, tmp_path: Path) -> None:
    c = child(tmp_path, "train: {betas: &b [0.9, 0.99]}\n"
                        "deepspeed: {extra: {a: &cfg {x: 1, y: [2, 3]}, b: *cfg, c: {<<: *cfg, y: [4]}, d: *b}}\n")
    r = load_recipe(c)
    assert r.train.betas == [0.9, 0.99]
    assert r.deepspeed.extra == {"a": {"x": 1, "y": [2, 3]}, "b": {"x": 1, "y": [2, 3]}, "c": {"x": 1, "y": [4]},
                                 "d": [0.9, 0.99]}


def test_the_resolved_recipe_gives_a_given_tokenizers_own_size(base: Path) -> None:
    """Issue 28 item 8: with ``tokenizer.path`` the BPE size key is ignored; recipe.resolved.yaml
    said 8192 (its default) for a 320-token tokenizer."""
    tok = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
    r = load_recipe(base, [f"tokenizer.path={tok}", "tokenizer.vocab_size=8192"])
    assert r.model_config.vocab_size == 320 and r.to_dict()["tokenizer"]["vocab_size"] == 320
    assert load_recipe(base).to_dict()["tokenizer"]["vocab_size"] == 512  # a BPE to train: the key as given
