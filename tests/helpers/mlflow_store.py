"""An MLflow client on a store, imported when a test reads one: importing mlflow costs ~1.5 s, which every
unit-tier run paid at collection while the modules that read stores imported it at their top."""

from __future__ import annotations


def mlflow_client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)
