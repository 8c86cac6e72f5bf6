"""Model-override providers, one module per model family. Importing this
package registers them (see ..registry)."""

from flotilla.resolution.rules.overrides.providers import deepseek  # noqa: F401
from flotilla.resolution.rules.overrides.providers import cohere2_moe  # noqa: F401
from flotilla.resolution.rules.overrides.providers import deepseek_v4  # noqa: F401
from flotilla.resolution.rules.overrides.providers import kimi_k3  # noqa: F401
from flotilla.resolution.rules.overrides.providers import minimax_m2  # noqa: F401
from flotilla.resolution.rules.overrides.providers import minimax_m3  # noqa: F401
from flotilla.resolution.rules.overrides.providers import mimo_v2  # noqa: F401
from flotilla.resolution.rules.overrides.providers import glm4_moe  # noqa: F401
from flotilla.resolution.rules.overrides.providers import exaone  # noqa: F401
from flotilla.resolution.rules.overrides.providers import falcon_h1  # noqa: F401
from flotilla.resolution.rules.overrides.providers import gemma2_gemma3  # noqa: F401
from flotilla.resolution.rules.overrides.providers import gemma4  # noqa: F401
from flotilla.resolution.rules.overrides.providers import gpt_oss  # noqa: F401
from flotilla.resolution.rules.overrides.providers import granitemoehybrid  # noqa: F401
from flotilla.resolution.rules.overrides.providers import inkling  # noqa: F401
from flotilla.resolution.rules.overrides.providers import interns2_mobius  # noqa: F401
from flotilla.resolution.rules.overrides.providers import lfm2  # noqa: F401
from flotilla.resolution.rules.overrides.providers import llama4  # noqa: F401
from flotilla.resolution.rules.overrides.providers import minicpm  # noqa: F401
from flotilla.resolution.rules.overrides.providers import minicpmv  # noqa: F401
from flotilla.resolution.rules.overrides.providers import moss_vl  # noqa: F401
from flotilla.resolution.rules.overrides.providers import muse_glimmer  # noqa: F401
from flotilla.resolution.rules.overrides.providers import nemotron_h  # noqa: F401
from flotilla.resolution.rules.overrides.providers import olmo2  # noqa: F401
from flotilla.resolution.rules.overrides.providers import qwen3_5  # noqa: F401
from flotilla.resolution.rules.overrides.providers import qwen3_moe  # noqa: F401
from flotilla.resolution.rules.overrides.providers import qwen3_vl  # noqa: F401
from flotilla.resolution.rules.overrides.providers import step3p  # noqa: F401
