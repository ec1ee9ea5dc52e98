"""PySpark data source "redisq" (DESIGN §5): arrives with the Spark connector issue."""
