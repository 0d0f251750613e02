package kubeenv_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"

	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
)

// TestMain checks for leaked goroutines after all tests. klog starts its
// flush daemon when client-go is imported and never stops it; that one
// goroutine is ignored, nothing else.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

var poolGVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// inferencePool is an InferencePool in the v1 shapes of the GIE v1.5.0 CRD
// (config/crd/bases/inference.networking.k8s.io_inferencepools.yaml):
//
//	spec.selector.matchLabels   map[string]string, 1 to 64 entries (required)
//	spec.targetPorts            [{number: int32 1..65535}], 1 to 8 items, unique numbers (required)
//	spec.endpointPickerRef      {name (required), port: {number} (required when kind is Service,
//	                             the default), kind (default "Service"), group (default ""),
//	                             failureMode (FailOpen | FailClose, default FailClose)} (required)
//	spec.appProtocol            "http" (default) | "kubernetes.io/h2c"
func inferencePool(ns, name string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1",
		"kind":       "InferencePool",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{
			"selector":    map[string]any{"matchLabels": map[string]any{"app": "sim"}},
			"targetPorts": []any{map[string]any{"number": int64(8000)}},
			"endpointPickerRef": map[string]any{
				"name": "kvbandit",
				"port": map[string]any{"number": int64(9002)},
			},
		},
	}}
}

// TestCluster runs one cluster through everything the harness offers: the
// CRDs, an InferencePool, Pods with a status, RBAC for the predefined users,
// Apply, and an API-server outage.
func TestCluster(t *testing.T) {
	c := kubeenv.Start(t)
	ctx := t.Context()
	client := c.Client(t)
	dyn := c.Dynamic(t)

	t.Run("Version", func(t *testing.T) {
		v, err := client.Discovery().ServerVersion()
		if err != nil {
			t.Fatal(err)
		}
		if v.GitVersion != "v1.36.3" {
			t.Errorf("server version %q, want v1.36.3 (tools/kube-apiserver/ldflags)", v.GitVersion)
		}
	})

	t.Run("CRDsEstablished", func(t *testing.T) {
		crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
		list, err := crds.List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]bool{}
		for _, u := range list.Items {
			got[u.GetName()] = true
		}
		for _, want := range []string{
			"inferencepools.inference.networking.k8s.io",
			"inferenceobjectives.inference.networking.x-k8s.io",
			"inferencemodelrewrites.inference.networking.x-k8s.io",
			"inferencepoolimports.inference.networking.x-k8s.io",
		} {
			if !got[want] {
				t.Errorf("CRD %s not installed; have %v", want, got)
			}
		}
	})

	t.Run("InferencePool", func(t *testing.T) {
		c.CreateNamespace(t, "pools")
		pools := dyn.Resource(poolGVR).Namespace("pools")
		if _, err := pools.Create(ctx, inferencePool("pools", "sim-pool"), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		got, err := pools.Get(ctx, "sim-pool", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		kind, _, _ := unstructured.NestedString(got.Object, "spec", "endpointPickerRef", "kind")
		mode, _, _ := unstructured.NestedString(got.Object, "spec", "endpointPickerRef", "failureMode")
		if kind != "Service" || mode != "FailClose" {
			t.Errorf("defaults: endpointPickerRef.kind %q failureMode %q, want Service FailClose", kind, mode)
		}
		// The schema is enforced: no targetPorts is rejected.
		bad := inferencePool("pools", "bad")
		unstructured.RemoveNestedField(bad.Object, "spec", "targetPorts")
		if _, err := pools.Create(ctx, bad, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
			t.Errorf("pool without targetPorts: err %v, want Invalid", err)
		}
	})

	t.Run("PodStatus", func(t *testing.T) {
		pod := c.CreatePod(t, "default", "sim-0", map[string]string{"app": "sim"}, map[string]string{"kvbandit.io/model": "m"})
		if pod.Status.PodIP != "" {
			t.Fatalf("new pod has IP %q", pod.Status.PodIP)
		}
		c.SetPodStatus(t, "default", "sim-0", "127.0.0.10", true)
		got, err := client.CoreV1().Pods("default").Get(ctx, "sim-0", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Status.PodIP != "127.0.0.10" || len(got.Status.PodIPs) != 1 || got.Status.Phase != "Running" || !podReady(got.Status.Conditions) {
			t.Errorf("status %+v", got.Status)
		}
		c.SetPodStatus(t, "default", "sim-0", "127.0.0.11", false)
		got, err = client.CoreV1().Pods("default").Get(ctx, "sim-0", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Status.PodIP != "127.0.0.11" || podReady(got.Status.Conditions) {
			t.Errorf("after not ready: status %+v", got.Status)
		}
	})

	t.Run("Users", func(t *testing.T) {
		for _, user := range []string{"nobody", "kvbandit", "kvbandit-2"} {
			cs, err := kubernetes.NewForConfig(c.UserConfig(user))
			if err != nil {
				t.Fatal(err)
			}
			_, err = cs.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
			if !apierrors.IsForbidden(err) {
				t.Errorf("%s lists pods: err %v, want Forbidden", user, err)
			} else if !strings.Contains(err.Error(), `"`+user+`"`) {
				t.Errorf("%s: error does not name the user: %v", user, err)
			}
		}
		// A Role and RoleBinding grant the kvbandit user what it needs, no more.
		grant := []byte(`
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: pod-reader, namespace: default}
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: kvbandit-pod-reader, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: kvbandit}
`)
		if err := c.Apply(ctx, grant, false); err != nil {
			t.Fatal(err)
		}
		cs, err := kubernetes.NewForConfig(c.UserConfig("kvbandit"))
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, "kvbandit may list pods", func() bool {
			_, err := cs.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
			return err == nil
		})
		if _, err := cs.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("kvbandit lists pods in kube-system: err %v, want Forbidden", err)
		}
		if path := c.Kubeconfig(t, "kvbandit"); path == "" {
			t.Error("no kubeconfig path")
		}
	})

	t.Run("Apply", func(t *testing.T) {
		doc := []byte(`
apiVersion: v1
kind: ConfigMap
metadata: {name: cm}
data: {a: b}
---
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: applied}
spec:
  selector: {matchLabels: {app: sim}}
  targetPorts: [{number: 8000}]
  endpointPickerRef: {name: kvbandit, port: {number: 9002}}
`)
		if err := c.Apply(ctx, doc, true); err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().ConfigMaps("default").Get(ctx, "cm", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("dry run stored the ConfigMap: err %v", err)
		}
		if err := c.Apply(ctx, doc, false); err != nil {
			t.Fatal(err)
		}
		if _, err := dyn.Resource(poolGVR).Namespace("default").Get(ctx, "applied", metav1.GetOptions{}); err != nil {
			t.Errorf("applied pool: %v", err)
		}
		bad := []byte(`
apiVersion: v1
kind: ConfigMap
metadata: {name: fine}
---
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: broken}
spec:
  selector: {matchLabels: {app: sim}}
  endpointPickerRef: {name: kvbandit}
`)
		err := c.Apply(ctx, bad, true)
		if err == nil || !strings.Contains(err.Error(), "InferencePool broken") {
			t.Errorf("invalid pool: err %v, want one naming InferencePool broken", err)
		}
	})

	t.Run("KillRestart", func(t *testing.T) {
		c.Kill()
		short, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := client.CoreV1().Namespaces().Get(short, "default", metav1.GetOptions{})
		cancel()
		if err == nil {
			t.Fatal("request succeeded with the API server killed")
		}
		c.Restart()
		if _, err := client.CoreV1().Pods("default").Get(ctx, "sim-0", metav1.GetOptions{}); err != nil {
			t.Fatalf("after Restart: %v", err)
		}
		if _, err := dyn.Resource(poolGVR).Namespace("pools").Get(ctx, "sim-pool", metav1.GetOptions{}); err != nil {
			t.Fatalf("pool after Restart: %v", err)
		}
	})
}

func podReady(conds []corev1.PodCondition) bool {
	for _, c := range conds {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
