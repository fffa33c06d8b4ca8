"""The shared fixtures do real work: a QoS 1 message through Mosquitto, a query through Spark."""

from __future__ import annotations

import queue

import paho.mqtt.client as mqtt
import pytest


@pytest.mark.broker
def test_broker_roundtrip_qos1(mosquitto) -> None:
    got: "queue.Queue[mqtt.MQTTMessage]" = queue.Queue()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fixture-sub", protocol=mqtt.MQTTv5)
    subscribed = queue.Queue()
    sub.on_message = lambda c, u, m: got.put(m)
    sub.on_subscribe = lambda c, u, mid, rc, props: subscribed.put(rc)
    sub.connect(mosquitto.host, mosquitto.port)
    sub.loop_start()
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fixture-pub", protocol=mqtt.MQTTv5)
    try:
        sub.subscribe("fixture/t", qos=1)
        subscribed.get(timeout=5)
        pub.connect(mosquitto.host, mosquitto.port)
        pub.loop_start()
        info = pub.publish("fixture/t", b"hello", qos=1)
        info.wait_for_publish(timeout=5)
        assert info.rc == mqtt.MQTT_ERR_SUCCESS
        msg = got.get(timeout=5)
        assert (msg.topic, msg.payload, msg.qos) == ("fixture/t", b"hello", 1)
    finally:
        for c in (pub, sub):
            c.disconnect()
            c.loop_stop()
    conf = mosquitto.conf_path.read_text()
    assert "max_queued_messages" in conf


@pytest.mark.spark
def test_spark_runs_a_query(spark) -> None:
    df = spark.createDataFrame([(1, "a"), (2, "b"), (3, "a")], ["n", "k"])
    rows = {r["k"]: r["s"] for r in df.groupBy("k").agg({"n": "sum"}).withColumnRenamed("sum(n)", "s").collect()}
    assert rows == {"a": 4, "b": 2}


def test_every_file_that_uses_spark_is_dealt_with_the_other_spark_files(request: pytest.FixtureRequest) -> None:
    """conftest.SPARK_FILES go to one test process together (one Spark session per run, not one
    per process): a new file whose tests take the `spark` fixture must be added there."""
    from conftest import SPARK_FILES, unit_of

    using = {item.nodeid.split("::", 1)[0] for item in request.session.items if "spark" in getattr(item, "fixturenames", ())}
    assert using <= SPARK_FILES, sorted(using - SPARK_FILES)
    assert {unit_of(f) for f in SPARK_FILES} == {"spark"}
