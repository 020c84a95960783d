"""ampd-tinker: Tinker's HTTP API in front of ampd, so that the tinker SDK
(ServiceClient, TrainingClient, SamplingClient) trains and samples on an
ampd server unchanged. See docs/TINKER.md."""
__version__ = "0.1.0"
