"""Federated datasets with subjects, their loaders, partitioners and feature scaling."""

from silodp.data.dataset import FederatedData, FederatedDataset, SplitSummary, TestSplit

__all__ = ["FederatedData", "FederatedDataset", "SplitSummary", "TestSplit"]
