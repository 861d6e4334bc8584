// crdvalidate runs the Kubernetes API server's own validation code, offline, on our CRDs and objects.
//
// Usage: crdvalidate CRD.yaml... < objects.json
//
// Each CRD goes through ValidateCustomResourceDefinition (structural schema rules, CEL compilation and
// cost estimation, defaults validated against the schema). Each object on stdin (a JSON list) is then
// handled as the API server handles a create: pruning of unknown fields (reported, as strict field
// validation does), defaulting, OpenAPI validation, list-set/map uniqueness and CEL validation. Prints one JSON document:
// {"crds": {file: [error...]}, "objects": [{"errors": [...], "object": <defaulted>}...]}.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	crdvalidation "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	structuraldefaulting "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	structurallisttype "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	structuralpruning "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	apiservervalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/runtime"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

type kindSchema struct {
	structural *structuralschema.Structural
	validator  apiservervalidation.SchemaValidator
	cel        *cel.Validator
}

type objectResult struct {
	Errors []string    `json:"errors"`
	Object interface{} `json:"object"`
}

type report struct {
	CRDs    map[string][]string `json:"crds"`
	Objects []objectResult      `json:"objects"`
}

func loadCRD(path string, scheme *runtime.Scheme) (*apiextensions.CustomResourceDefinition, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	v1 := &apiextv1.CustomResourceDefinition{}
	if err := yaml.UnmarshalStrict(data, v1); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	apiextv1.SetObjectDefaults_CustomResourceDefinition(v1)
	internal := &apiextensions.CustomResourceDefinition{}
	if err := scheme.Convert(v1, internal, nil); err != nil {
		return nil, fmt.Errorf("convert: %w", err)
	}
	return internal, nil
}

func main() {
	scheme := runtime.NewScheme()
	if err := apiextensions.AddToScheme(scheme); err != nil {
		panic(err)
	}
	if err := apiextv1.AddToScheme(scheme); err != nil {
		panic(err)
	}
	out := report{CRDs: map[string][]string{}, Objects: []objectResult{}}
	kinds := map[string]kindSchema{}
	for _, path := range os.Args[1:] {
		problems := []string{}
		crd, err := loadCRD(path, scheme)
		if err != nil {
			out.CRDs[path] = []string{err.Error()}
			continue
		}
		for _, e := range crdvalidation.ValidateCustomResourceDefinition(context.Background(), crd) {
			problems = append(problems, e.Error())
		}
		out.CRDs[path] = problems
		if len(problems) > 0 {
			continue
		}
		props := crd.Spec.Validation
		if props == nil {
			props = crd.Spec.Versions[0].Schema
		}
		ss, err := structuralschema.NewStructural(props.OpenAPIV3Schema)
		if err != nil {
			out.CRDs[path] = []string{err.Error()}
			continue
		}
		validator, _, err := apiservervalidation.NewSchemaValidator(props.OpenAPIV3Schema)
		if err != nil {
			out.CRDs[path] = []string{err.Error()}
			continue
		}
		kinds[crd.Spec.Names.Kind] = kindSchema{ss, validator, cel.NewValidator(ss, true, celconfig.PerCallLimit)}
	}

	input, err := io.ReadAll(os.Stdin)
	if err != nil {
		panic(err)
	}
	var objects []map[string]interface{}
	if len(input) > 0 {
		// As the API server decodes: whole numbers become int64, not float64.
		if err := utiljson.Unmarshal(input, &objects); err != nil {
			panic(err)
		}
	}
	for _, obj := range objects {
		result := objectResult{Errors: []string{}, Object: obj}
		kind, _ := obj["kind"].(string)
		k, ok := kinds[kind]
		if !ok {
			result.Errors = append(result.Errors, fmt.Sprintf("no valid CRD for kind %q", kind))
			out.Objects = append(out.Objects, result)
			continue
		}
		opts := structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true}
		for _, unknown := range structuralpruning.PruneWithOptions(obj, k.structural, true, opts) {
			result.Errors = append(result.Errors, fmt.Sprintf("unknown field %q", unknown))
		}
		structuraldefaulting.Default(obj, k.structural)
		for _, e := range apiservervalidation.ValidateCustomResource(nil, obj, k.validator) {
			result.Errors = append(result.Errors, e.Error())
		}
		for _, e := range structurallisttype.ValidateListSetsAndMaps(nil, k.structural, obj) {
			result.Errors = append(result.Errors, e.Error())
		}
		if k.cel != nil {
			errs, _ := k.cel.Validate(context.Background(), nil, k.structural, obj, nil, celconfig.RuntimeCELCostBudget)
			for _, e := range errs {
				result.Errors = append(result.Errors, e.Error())
			}
		}
		out.Objects = append(out.Objects, result)
	}
	encoded, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		panic(err)
	}
	fmt.Println(string(encoded))
}
