import copy

import pytest
import yaml

from fedsilo.cli import main
from fedsilo.config import ConfigError
from fedsilo.fl.params import load_params, parse_params
from tests.conftest import REPO, small_params


def test_repo_params_yaml_is_valid():
    p = load_params(REPO / "params.yaml")
    assert "cxr4_quickstart" in p.experiments
    assert set(p.pipeline.methods) >= {"single", "fedavg", "fedprox", "fedbn"}


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda d: d["methods"]["fedprox"].update(mu=-1), "methods.fedprox.mu"),
        (lambda d: d["methods"]["fedprox"].update(mux=1), "methods.fedprox.mux: unknown key"),
        (lambda d: d["experiments"]["quick"]["train"].update(rounds=0), "experiments.quick.train.rounds"),
        (lambda d: d["experiments"]["quick"]["train"].update(lr="fast"), "experiments.quick.train.lr"),
        (lambda d: d["datasets"]["chest_xray4"].update(colour=True), "datasets.chest_xray4.colour: unknown key"),
        (lambda d: d["datasets"]["chest_xray4"].update(vinbigdata={"opacity_rule": "some"}), "datasets.chest_xray4.vinbigdata.opacity_rule"),
        (lambda d: d["sources"]["rsna"].update(mode="local"), "sources.rsna"),
        (lambda d: d.update(extra_section={}), "extra_section: unknown key"),
        (lambda d: d["methods"].update(fedmagic={}), "methods.fedmagic: unknown method"),
        (lambda d: d["pipeline"]["methods"].append("ditto"), "pipeline.methods: 'ditto' is not defined"),
        # a near miss of a known name is named (a typo), a far one is not
        (lambda d: d["methods"]["fedprox"].update(muu=1), "methods.fedprox.muu: unknown key (did you mean 'mu'?)"),
        (lambda d: d["experiments"]["quick"]["train"].update(lr_shedule={}), "train.lr_shedule: unknown key (did you mean 'lr_schedule'?)"),
        (lambda d: d["pipeline"]["methods"].append("fedprx"), "pipeline.methods: 'fedprx' is not defined under 'methods' (did you mean 'fedprox'?)"),
        # the near miss is one of the section's own keys: FedProx has no temperature (MOON's), train no sigma (F²DC's)
        (lambda d: d["methods"]["fedprox"].update(temperatur=1), "methods.fedprox.temperatur: unknown key"),
        (lambda d: d["experiments"]["quick"]["train"].update(sigmaa=1), "train.sigmaa: unknown key"),
        (lambda d: d["pipeline"].update(seeds=[0, 1, 0]), "pipeline.seeds: seed(s) [0] listed twice"),
        # a negative seed: refused before any stage (every round's seeded streams take non-negative keys)
        (lambda d: d["pipeline"].update(seeds=[0, -1]), "pipeline.seeds: seed(s) [-1]: a seed is a non-negative integer"),
        (lambda d: d["pipeline"].update(seeds=0), "pipeline.seeds: 0: seeds are a list, one run of each method per seed (e.g. seeds: [0])"),
        # a split's protocol changed, its old settings left: each named as the other protocol's, not a near miss
        (lambda d: d["experiments"]["quick"]["split"].update(protocol="label_skew"),
         "experiments.quick.split.n_train: unknown key (a key of protocol domain_clients, holdout_domain, not of label_skew)"),
        (lambda d: d["experiments"]["quick"]["split"].update(seed=-3), "experiments.quick.split.seed: Input should be greater than or equal to 0"),
        # a dataset's kind changed, a key of its old kind left (a kind of several values: the benchmarks')
        (lambda d: d["datasets"]["chest_xray4"].update(kind="pacs", percentiles=[1, 99]),
         "datasets.chest_xray4.percentiles: unknown key (a key of kind chest_xray4, not of pacs)"),
        (lambda d: d["datasets"]["chest_xray4"].update(percentiles=[50, 50]), "datasets.chest_xray4.percentiles: need 0 <= low < high <= 100"),
        (lambda d: d["datasets"]["chest_xray4"].update(folders={}),
         "datasets.chest_xray4.folders: unknown key (a key of kind digits5, office_caltech10, pacs, domainnet10, digit10, ..., not of chest_xray4)"),
    ],
)
def test_bad_value_names_the_key(edit, key):
    raw = copy.deepcopy(small_params())
    edit(raw)
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert key in str(err.value)
    if "extra_section" in key or "temperatur" in key or "sigmaa" in key:  # no key of its own section is near it
        assert "did you mean" not in str(err.value)


def test_a_key_valid_in_another_section_is_not_offered_back_as_its_own_near_miss():
    raw = copy.deepcopy(small_params())
    raw["pipeline"]["lr"] = 1  # train's key, in the wrong section
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert "pipeline.lr: unknown key" in str(err.value) and "did you mean 'lr'" not in str(err.value)


def test_a_near_miss_is_never_the_name_itself():
    from fedsilo.config import did_you_mean

    assert did_you_mean("lr", ["lr"]) == ""
    assert did_you_mean("lr", ["lr", "lrr"]) == " (did you mean 'lrr'?)"


def test_cli_check_params_reports_key_and_exits_2(tmp_path, capsys):
    raw = small_params()
    raw["experiments"]["quick"]["train"]["batch_size"] = -4
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["--params", str(tmp_path / "params.yaml"), "check-params"]) == 2
    assert "experiments.quick.train.batch_size" in capsys.readouterr().err


def test_named_method_variants_resolve_to_their_registered_method(tmp_path):
    from fedsilo.methods import method_base, method_params
    from tests.conftest import small_params

    raw = small_params()
    raw["methods"]["fedavg_two_phase"] = {"method": "fedavg", "local_rounds": 2}
    p = parse_params(raw)
    assert method_base("fedavg_two_phase", p.methods["fedavg_two_phase"]) == "fedavg"
    assert method_params(p, "fedavg_two_phase").local_rounds == 2
    raw["methods"]["fedavg_two_phase"]["mu"] = 0.1
    with pytest.raises(ConfigError, match=r"methods\.fedavg_two_phase\.mu: unknown key"):
        parse_params(raw)
    del raw["methods"]["fedavg_two_phase"]["mu"]
    raw["methods"]["oops"] = {"method": "fedawg"}
    with pytest.raises(ConfigError, match=r"methods\.oops: unknown method 'fedawg' \(did you mean 'fedavg'\?\)"):
        parse_params(raw)
    # a method of one's own written but not registered: where it is registered
    raw["methods"]["oops"] = {}
    with pytest.raises(ConfigError, match=r"methods\.oops: unknown method 'oops' .*; a method of your own is known once its "
                       r"class is in REGISTRY of src/fedsilo/methods/registry\.py"):
        parse_params(raw)


@pytest.mark.parametrize("setting", [{"finetune_epochs": 1}, {"local_rounds": 1}])
def test_check_params_refuses_what_a_stream_train_stage_would(setting):
    """FedAvg's fine-tuning and two-phase start are not defined on a stream of domain tasks: check-params says so
    (the stage that guards every train stage), not the train stage after it."""
    from fedsilo.methods.registry import check_methods

    raw = copy.deepcopy(small_params())
    raw["experiments"] = {"stream": {"dataset": "chest_xray4", "split": {"protocol": "domain_incremental", "clients": 2},
                                     "train": raw["experiments"]["quick"]["train"]}}
    raw["methods"] = {"fedavg_ft": {"method": "fedavg", **setting}}
    raw["pipeline"].update({"splits": {"stream": "chest_xray4"}, "experiments": ["stream"], "methods": ["fedavg_ft"]})
    with pytest.raises(ConfigError, match=rf"methods\.fedavg_ft\.{next(iter(setting))}: not defined on a stream of domain tasks"):
        check_methods(parse_params(raw))


def test_errors_name_the_params_file_the_params_came_from(tmp_path):
    from fedsilo.config import load_params
    from fedsilo.methods.registry import method_params

    path = tmp_path / "hospital_params.yaml"
    path.write_text(yaml.safe_dump(small_params()))
    p = load_params(path)
    assert p.source == str(path)
    with pytest.raises(ConfigError, match=rf"methods\.nosuch: not defined in {path}"):
        method_params(p, "nosuch")


def test_a_value_of_the_wrong_kind_is_echoed_in_its_error():
    """`compile: ture`, `rounds: 0`, `amp: bf32`: pydantic's message says what was expected; the error says what was
    written too."""
    raw = small_params()
    raw["experiments"]["quick"]["train"].update(compile="ture", rounds=0, amp="bf32")
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    said = str(err.value)
    assert "experiments.quick.train.compile: Input should be a valid boolean, unable to interpret input (got 'ture')" in said
    assert "experiments.quick.train.rounds: Input should be greater than or equal to 1 (got 0)" in said
    assert "experiments.quick.train.amp: Input should be 'auto', 'off' or 'bf16' (got 'bf32')" in said
    # a number the message also holds as its limit, and a list where a number belongs: echoed all the same
    raw = small_params()
    raw["experiments"]["quick"]["train"].update(lr=0, batch_size=[8])
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    said = str(err.value)
    assert "experiments.quick.train.lr: Input should be greater than 0 (got 0)" in said
    assert "experiments.quick.train.batch_size: Input should be a valid integer (got [8])" in said


def test_a_method_neither_registered_nor_in_the_params_file_says_where_a_method_of_ones_own_is_registered():
    """method_params and describe_method (check-params --method): a method name with no near miss among the params
    file's methods says where a method of one's own is registered, as an unknown `method:` does."""
    from fedsilo.methods.registry import describe_method, method_params

    p = parse_params(small_params())
    hint = "; a method of your own is known once its class is in REGISTRY of src/fedsilo/methods/registry.py"
    for call in (lambda: method_params(p, "my_method"), lambda: describe_method(p, "my_method")):
        with pytest.raises(ConfigError) as err:
            call()
        assert hint in str(err.value), err.value


def test_a_long_value_is_not_echoed_in_its_error():
    """A value of the wrong kind is echoed after pydantic's message, unless its repr is long (a pasted list): the
    error stays one readable line."""
    raw = small_params()
    raw["experiments"]["quick"]["train"].update(batch_size=list(range(40)))
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert "experiments.quick.train.batch_size: Input should be a valid integer" in str(err.value)
    assert "(got [" not in str(err.value), err.value
