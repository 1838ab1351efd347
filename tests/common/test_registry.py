"""The registry (common/registry.py): built-ins and plugins found the same way, from installed
metadata; clashes, module paths and disallowed plugins refused in one line, importing nothing."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fedseq.common import __version__
from fedseq.common.config import load_config
from fedseq.common.errors import ConfigError
from fedseq.common.models import ModuleBlocks, build_model, model_spec
from fedseq.common.registry import GROUPS, REGISTRY, RegistryError


def fake_distribution(site: Path, dist: str, version: str, entry_points: dict, modules: dict) -> None:
    """What `pip install` leaves in a site folder: the modules, and a dist-info with the
    distribution's METADATA and entry_points.txt (importlib.metadata reads nothing else)."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, names in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in names.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path):
    """A site folder on sys.path for the test's fake distributions; the registry rescanned."""
    folder = tmp_path / "site"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    REGISTRY.refresh()
    yield folder
    sys.path.remove(str(folder))
    for name in [m for m in sys.modules if m.startswith("tinylab")]:
        del sys.modules[name]
    REGISTRY.restrict(None)
    REGISTRY.refresh()


TINYLAB = """
    from torch import nn

    class Net(nn.Module):
        def __init__(self, features, classes, width):
            super().__init__()
            self.first = nn.Linear(features, width)
            self.act = nn.ReLU()          # no parameters: not a block
            self.second = nn.Linear(width, width)
            self.out = nn.Linear(width, classes)

        def forward(self, x):
            return self.out(self.act(self.second(self.act(self.first(x.flatten(1))))))

    def make(input_shape, num_classes, width=8):
        c, h, w = input_shape
        return Net(c * h * w, num_classes, width)
"""


def test_builtins_come_from_fedsecs_own_metadata_like_a_plugin():
    """Every built-in is an entry point of the installed fedseq distribution, and loads."""
    for group in GROUPS:
        entries = REGISTRY.entries(group)
        assert entries and all(e.distribution == "fedseq" and e.builtin for e in entries)
        for e in entries:
            assert REGISTRY.load(group, e.name) is not None
    assert {"cnn", "convnet", "resnet18"} <= set(REGISTRY.names("models"))
    assert {"mean", "median", "krum"} <= set(REGISTRY.names("aggregators"))
    assert "fedreg" in REGISTRY.names("algorithms") and "fmnist" in REGISTRY.names("datasets")


def test_a_plugin_model_is_found_by_its_name_and_imported_only_when_used(site):
    fake_distribution(site, "tiny-lab", "1.2.0", {"fedseq.models": {"tinynet": "tinylab:make"}},
                      {"tinylab": TINYLAB})
    REGISTRY.refresh()
    entry = REGISTRY.entry("models", "tinynet")
    assert (entry.distribution, entry.version, entry.builtin) == ("tiny-lab", "1.2.0", False)
    assert "tinylab" not in sys.modules  # named, checked, not imported
    cfg = load_config(None, ["model.name=tinynet", "model.options.width=6"])
    assert "tinylab" not in sys.modules
    model = build_model(cfg.model.name, (1, 4, 4), 3, generator_seed=0, options=cfg.model.options)
    assert "tinylab" in sys.modules
    assert isinstance(model, ModuleBlocks)
    assert model.spec.base == ("first", "second") and model.spec.head == "out"
    assert model.spec == model_spec("tinynet", False, in_shape=(1, 4, 4), num_classes=3,
                                    options={"width": 6})
    assert sorted(model.state_dict()) == ["first.bias", "first.weight", "out.bias", "out.weight",
                                          "second.bias", "second.weight"]
    x = torch.randn(5, 1, 4, 4)
    feats = model.features(x)
    assert feats.shape == (5, 6)
    # the features are the head's input: the module's own forward, logits through the head
    assert torch.allclose(model.logits(feats, ("out",)), model._net(x))
    again = build_model("tinynet", (1, 4, 4), 3, generator_seed=0, options={"width": 6})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))


def test_a_plain_module_gets_a_fresh_personal_head_for_two_head_algorithms(site):
    fake_distribution(site, "tiny-lab", "1.2.0", {"fedseq.models": {"tinynet": "tinylab:make"}},
                      {"tinylab": TINYLAB})
    REGISTRY.refresh()
    model = build_model("tinynet", (1, 4, 4), 3, two_heads=True, generator_seed=0)
    assert model.spec.personal_head == "out_p"
    assert model.out_p.weight.shape == model.out.weight.shape
    assert not torch.equal(model.out_p.weight, model.out.weight)


def test_a_model_that_has_no_blocks_fedseq_can_name_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="at least two"):
        ModuleBlocks(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)), False)
    loose = nn.Module()
    loose.a, loose.b = nn.Linear(2, 2), nn.Linear(2, 2)
    loose.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match="scale.*outside any child"):
        ModuleBlocks(loose, False)
    with pytest.raises(ConfigError, match="running statistics"):
        ModuleBlocks(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)), False)


def test_one_name_from_two_distributions_is_an_error_naming_both(site):
    for dist in ("lab-a", "lab-b"):
        fake_distribution(site, dist, "0.1", {"fedseq.models": {"twin": f"{dist.replace('-', '')}:m"}}, {})
    REGISTRY.refresh()
    with pytest.raises(RegistryError) as err:
        REGISTRY.names("models")
    assert "lab-a" in str(err.value) and "lab-b" in str(err.value) and "\n" not in str(err.value)


def test_a_plugin_may_not_take_a_builtin_name(site):
    fake_distribution(site, "squatter", "9.9", {"fedseq.algorithms": {"fedavg": "tinylab:x"}}, {})
    REGISTRY.refresh()
    with pytest.raises(RegistryError, match="'fedavg' is registered by two") as err:
        REGISTRY.entry("algorithms", "fedavg")
    assert "squatter 9.9" in str(err.value) and f"fedseq {__version__}" in str(err.value)


@pytest.mark.parametrize("key", ["model.name", "algorithm.name", "data.dataset", "aggregation.rule"])
@pytest.mark.parametrize("value", ["tinylab:make", "os.path:join", "tinylab.make", "../x/y"])
def test_a_module_path_is_refused_in_one_line_and_imports_nothing(site, key, value):
    fake_distribution(site, "tiny-lab", "1.2.0", {"fedseq.models": {"tinynet": "tinylab:make"}},
                      {"tinylab": TINYLAB})
    REGISTRY.refresh()
    with pytest.raises(ConfigError, match="module path") as err:
        load_config(None, [f"{key}={value!r}"])
    assert "\n" not in str(err.value)
    assert "tinylab" not in sys.modules


def test_a_device_resolves_only_builtins_and_the_plugins_it_allows(site):
    fake_distribution(site, "tiny-lab", "1.2.0", {"fedseq.models": {"tinynet": "tinylab:make"}},
                      {"tinylab": TINYLAB})
    REGISTRY.refresh()
    REGISTRY.restrict([])
    with pytest.raises(ConfigError, match="not allowed on this device.*--allow-plugin tinynet") as err:
        load_config(None, ["model.name=tinynet"])
    assert "tinylab" not in sys.modules and "\n" not in str(err.value)
    assert load_config(None, ["model.name=cnn"]).model.name == "cnn"  # built-ins: always
    REGISTRY.restrict(["tinynet"])
    assert load_config(None, ["model.name=tinynet"]).model.name == "tinynet"


def test_an_entry_that_cannot_be_imported_names_its_package(site):
    fake_distribution(site, "broken-lab", "0.0.1", {"fedseq.aggregators": {"broken": "nolab.x:rule"}}, {})
    REGISTRY.refresh()
    # a plugin rule is loaded with the config (its options are its own to check): refused there
    with pytest.raises(ConfigError, match="broken-lab 0.0.1 cannot be loaded from nolab.x:rule") as err:
        load_config(None, ["aggregation.rule=broken"])
    assert "\n" not in str(err.value)


def test_an_algorithm_whose_class_names_another_name_is_refused(site):
    fake_distribution(site, "alias-lab", "1.0", {"fedseq.algorithms": {"myavg": "tinyalgo:Avg"}},
                      {"tinyalgo": "from fedseq.common.algorithms.fedavg import FedAvg as Avg\n"})
    REGISTRY.refresh()
    from fedseq.common.algorithms import algorithm_class

    with pytest.raises(RegistryError, match="names itself 'fedavg'"):
        algorithm_class("myavg")


def test_a_stale_egg_info_in_a_checkout_does_not_hide_the_installed_metadata(site):
    """A build leaves <name>.egg-info in a source checkout; where Python runs from there it comes
    first on sys.path, and after a pyproject change it is stale: the installed one counts."""
    (site / "fedseq.egg-info").mkdir()
    (site / "fedseq.egg-info" / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: fedseq\nVersion: 0.0.0\n")
    (site / "fedseq.egg-info" / "entry_points.txt").write_text("[console_scripts]\nx = y:z\n")
    REGISTRY.refresh()
    assert "cnn" in REGISTRY.names("models")
    assert REGISTRY.entry("models", "cnn").version != "0.0.0"


def test_a_plugin_is_pinned_to_its_code_and_other_code_under_its_version_is_refused(site):
    """Hardening VII, finding 9: a device with other code installed under the same plugin
    version (an edited `pip install -e` checkout) joined and changed the result without a word.
    A run pins each plugin to a digest of its source (found without importing it); a device
    whose source differs refuses the run in one line naming the plugin, unless the coordinator
    runs with deploy.pin_plugin_code = false."""
    fake_distribution(site, "tiny-lab", "1.2.0", {"fedseq.models": {"tinynet": "tinylab:make"}},
                      {"tinylab": TINYLAB})
    REGISTRY.refresh()
    pins = REGISTRY.pins({"models": "tinynet", "algorithms": "fedavg"})
    version, _, digest = pins["models/tinynet"].partition(" code ")
    assert version == "tiny-lab==1.2.0" and len(digest) == 16 and "tinylab" not in sys.modules
    assert REGISTRY.pin_problem(pins) is None
    (site / "tinylab.py").write_text((site / "tinylab.py").read_text().replace("width=8", "width=9"))
    why = REGISTRY.pin_problem(pins)
    assert why is not None and why.startswith(
        "model 'tinynet' (tiny-lab 1.2.0) runs other code here than on the coordinator")
    assert "deploy.pin_plugin_code = false" in why and len(why.splitlines()) == 1
    unpinned = REGISTRY.pins({"models": "tinynet"}, code=False)
    assert unpinned == {"models/tinynet": "tiny-lab==1.2.0"}
    assert REGISTRY.pin_problem(unpinned) is None
    assert "is tiny-lab==1.1.0 on the coordinator" in REGISTRY.pin_problem(
        {"models/tinynet": "tiny-lab==1.1.0 code " + digest})
