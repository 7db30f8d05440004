"""Config of several models: `[[engines]] model`, `[[fleet.models]]`, and the startup errors that name the model."""

from __future__ import annotations

import pytest

from narwhal.config import ConfigError, parse_config
from narwhal.fleet.registry import entries_from_config
from narwhal.served_models import ServedModels

ENGINES = """
[[engines]]
name = "pa"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "da"
url = "http://127.0.0.1:9002"
role = "decode"
[[engines]]
name = "pb"
url = "http://127.0.0.1:9003"
role = "prefill"
model = "beta"
[[engines]]
name = "db"
url = "http://127.0.0.1:9004"
role = "decode"
model = "beta"
"""


def test_an_engine_without_model_serves_the_fleet_model_and_each_model_is_a_pool():
    config = parse_config('[fleet]\nmodel = "alpha"\ngeneration = "g7"\n' + ENGINES)
    assert [(spec.name, spec.model) for spec in config.engines] == [
        ("pa", "alpha"), ("da", "alpha"), ("pb", "beta"), ("db", "beta")]
    assert [entry.model for entry in entries_from_config(config)] == ["alpha", "alpha", "beta", "beta"]
    models = ServedModels.of(config)
    assert models.names() == ["alpha", "beta"]
    assert models.only is None
    assert models.models["beta"].generation == "g7"
    assert models.decode_engines == {"alpha": frozenset({"da"}), "beta": frozenset({"db"})}


def test_per_model_keys_override_the_fleet_and_serving_values():
    config = parse_config("""
[serving]
policy = "bounded"
max_attempts = 4
request_deadline_s = 60
[fleet]
model = "alpha"
generation = "g1"
[[fleet.models]]
name = "beta"
generation = "g2"
aliases = ["beta-latest"]
max_attempts = 2
request_deadline_s = 10
""" + ENGINES)
    models = ServedModels.of(config)
    beta, alpha = models.models["beta"], models.models["alpha"]
    assert (beta.generation, beta.aliases, beta.max_attempts, beta.request_deadline_s) == (
        "g2", ("beta-latest",), 2, 10.0)
    assert (alpha.generation, alpha.aliases, alpha.max_attempts, alpha.request_deadline_s) == ("g1", (), 4, 60.0)
    assert models.resolve("beta-latest") is beta and models.resolve("nope") is None


def test_the_saturate_policy_makes_one_attempt_whatever_a_model_says():
    config = parse_config('[fleet]\nmodel = "alpha"\n[[fleet.models]]\nname = "beta"\nmax_attempts = 5\n' + ENGINES)
    assert ServedModels.of(config).models["beta"].max_attempts == 1


def test_one_model_config_is_unchanged():
    config = parse_config(ENGINES.split('[[engines]]\nname = "pb"')[0])
    models = ServedModels.of(config)
    assert models.names() == ["mock-model"] and models.only is models.models["mock-model"]


@pytest.mark.parametrize(("extra", "engines", "message"), [
    # A model whose pool lacks a role: the error names the model and the role.
    ("", ENGINES.replace('name = "db"\nurl = "http://127.0.0.1:9004"\nrole = "decode"',
                         'name = "db"\nurl = "http://127.0.0.1:9004"\nrole = "prefill"'),
     "model 'beta' has no decode engine"),
    # A [[fleet.models]] entry with no engines at all.
    ('[[fleet.models]]\nname = "gamma"\n', ENGINES, "model 'gamma' has no prefill engine"),
    # An alias that is another model's name.
    ('[[fleet.models]]\nname = "beta"\naliases = ["alpha"]\n', ENGINES,
     "'alpha' is both a served model and an alias of 'beta'"),
    # One alias for two models.
    ('[[fleet.models]]\nname = "beta"\naliases = ["x"]\n[[fleet.models]]\nname = "alpha"\naliases = ["x"]\n',
     ENGINES, "'x' names two models"),
    ('[[fleet.models]]\nname = "beta"\n[[fleet.models]]\nname = "beta"\n', ENGINES,
     "model 'beta' has two [[fleet.models]] entries"),
    ('[[fleet.models]]\nname = "beta"\naliases = ["beta"]\n', ENGINES, "lists a name twice"),
    ('[[fleet.models]]\nname = "beta"\naliases = [""]\n', ENGINES, "fleet.models[0]: aliases[0] must not be empty"),
    ('[[fleet.models]]\nname = "beta"\nmax_attempts = 0\n', ENGINES, "fleet.models[0]: max_attempts must be > 0"),
    ('[[fleet.models]]\nname = "beta"\nrequest_deadline_s = -1\n', ENGINES,
     "fleet.models[0]: request_deadline_s must be > 0"),
    ('[[fleet.models]]\nname = "beta"\nmax_attempt = 2\n', ENGINES,
     "fleet.models[0].max_attempt: unknown key (did you mean 'max_attempts'?)"),
    ("", ENGINES.replace('model = "beta"', 'model = ""', 1), 'engine "pb": model must not be empty'),
])
def test_a_bad_models_config_is_refused_with_a_message_naming_the_key_or_model(extra, engines, message):
    with pytest.raises(ConfigError) as caught:
        parse_config('[fleet]\nmodel = "alpha"\n' + extra + engines)
    assert message in str(caught.value)


def test_one_engine_url_for_a_role_in_two_models_is_refused():
    # One process listed twice would get a double share of placement and of evidence.
    text = ENGINES.replace('url = "http://127.0.0.1:9003"', 'url = "http://127.0.0.1:9001"')
    with pytest.raises(ConfigError, match="also engine"):
        parse_config(text)
