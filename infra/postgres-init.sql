-- MLflow's runs live beside Prefect's state, in their own database.
CREATE DATABASE mlflow OWNER tokenmill;
