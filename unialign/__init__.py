"""unialign: align language models and diffusion models with the same RL and preference code.

`import unialign` is light: it pulls in torch only. Text, image, reward and trainer code live in
subpackages that import transformers / diffusers / open_clip / accelerate lazily, where used.
"""

from unialign.types import PreferenceBatch, Trajectory

__version__ = "0.1.0"
__all__ = ["PreferenceBatch", "Trajectory", "__version__"]
