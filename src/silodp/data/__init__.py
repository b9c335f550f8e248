"""Federated datasets with subjects, their loaders and partitioners."""

from silodp.data.dataset import FederatedData, FederatedDataset, TestSplit

__all__ = ["FederatedData", "FederatedDataset", "TestSplit"]
