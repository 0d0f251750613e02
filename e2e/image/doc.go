// Package image tests kvbandit's container image end to end: `make image`
// builds it offline with buildah into a private store, and podman runs it
// with runc, as a container user would. The package has no code outside
// its tests; README.md ("Container image") says what they need.
package image
